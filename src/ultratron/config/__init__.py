"""Typed configuration. `loader` is the mechanism every config of ultratron shares (TOML,
`--section.field` overrides, flags generated from dataclasses); `training` is the training
run's config."""

from ultratron.config.loader import did_you_mean, to_dict, to_toml
from ultratron.config.training import (
    CheckpointConfig,
    Config,
    DataConfig,
    EndpointConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    load_config,
    resolve_model,
    validate,
)
from ultratron.errors import ConfigError

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "EndpointConfig", "EvalConfig", "ModelConfig",
           "OptimConfig", "ParallelConfig", "RunConfig", "TrainingConfig", "did_you_mean", "load_config",
           "resolve_model", "to_dict", "to_toml", "validate"]
