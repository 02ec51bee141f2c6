"""Errors a user can cause and fix: printed as one clear line each, never as a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Base of every error caused by input the user controls (config, data, checkpoint, request)."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class DataError(UserError):
    """Missing, empty or malformed training data."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or does not match the run."""


def format_user_error(err: UserError) -> str:
    return "\n".join(f"error: {line}" for line in err.problems)
