"""Job configuration: a YAML file, `--set` overrides on top, one validated, frozen object.

    cfg = load("jobs/default.yaml", overrides=["parallel.tp=4", "train.lr=3e-4"])

The schema (raytp.config.schema) is typed dataclasses whose fields carry their
help text and valid values; parse reads files and overrides, rules checks a
whole job. What the rest of raytp needs of a job in its own terms (the model's
shape, the optimiser's knobs) comes from raytp.config.adapters.
"""
from raytp.config.parse import describe, from_dict, load
from raytp.config.rules import adjusted, validate
from raytp.config.schema import (CheckpointConfig, DataConfig, JobConfig, ModelConfig, ParallelConfig,
                                 RecoveryConfig, RuntimeConfig, TrainConfig)
from raytp.config.values import ConfigError, Range

__all__ = ["CheckpointConfig", "ConfigError", "DataConfig", "JobConfig", "ModelConfig", "ParallelConfig", "Range",
           "RecoveryConfig", "RuntimeConfig", "TrainConfig", "adjusted", "describe", "from_dict", "load", "validate"]
