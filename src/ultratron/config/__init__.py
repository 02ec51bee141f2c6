"""Typed configuration. `loader` is the mechanism every config of ultratron shares (TOML,
`--section.field` overrides, flags generated from dataclasses); `training` is the training
run's config.

The names below are imported when first used (`from ultratron.config import Config` works as
before): a command that needs only its own settings (`ultratron eval --endpoint`,
`config.inference`) does not pay for the training config's import (~45 ms of a start of ~0.2 s)."""

from __future__ import annotations

import importlib

_TRAINING = ("CheckpointConfig", "Config", "DataConfig", "EvalConfig", "ModelConfig", "OptimConfig",
             "ParallelConfig", "RunConfig", "TrainingConfig", "load_config", "resolve_model", "validate")
_HOMES = {**dict.fromkeys(_TRAINING, "ultratron.config.training"),
          **dict.fromkeys(("did_you_mean", "to_dict", "to_toml"), "ultratron.config.loader"),
          "EndpointConfig": "ultratron.config.endpoint", "ConfigError": "ultratron.errors"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(home), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
