"""Errors a user can cause and fix: printed as one clear line each, never as a traceback.

Every error class of ultratron lives here, so any layer can raise one without importing another.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of every error caused by input the user controls (config, data, checkpoint, request)."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class ConfigError(UserError):
    """A configuration (TOML file or --section.field flag) the user can fix; one line per problem."""


class DataError(UserError):
    """Missing, empty or malformed training data."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or does not match the run."""


class CheckpointStorageError(CheckpointError):
    """Checkpoint storage that cannot take a save (full, read-only, no permission): training stops."""


class TrainingError(UserError):
    """Training that cannot go on by itself (e.g. loss spikes beyond the configured rollbacks)."""


class TaskError(UserError):
    """An evaluation task file or task name that cannot be used."""


class ExportError(UserError):
    """A model that cannot be written in the requested format."""


class EndpointError(UserError):
    """An OpenAI-compatible endpoint that refuses, fails or cannot be reached (after the retries)."""


class DeviceError(UserError):
    """A requested device (e.g. CUDA) that this machine does not have."""


def format_user_error(err: UserError) -> str:
    return "\n".join(f"error: {line}" for line in err.problems)
