"""The ``tracking`` section's mappings: where a run's records also go (W&B, MLflow). Pure values.

Each is a frozen dataclass that reads itself from a job file's mapping (``parse``: the config parser hands a
mapping-typed key's value to its type's ``parse``), naming what is unknown, missing or not a string.
``LIBRARIES`` says which Python module each tracking key needs: a job naming one that is not installed is
refused before anything starts (raytp.config.rules).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

LIBRARIES = {"tracking.tensorboard": "tensorboard", "tracking.wandb": "wandb", "tracking.mlflow": "mlflow"}


def _parse(cls, value: Any, required: tuple[str, ...]):
    if isinstance(value, cls):
        return value
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of {', '.join(names)}, got {type(value).__name__}")
    problems = [f"unknown field {k!r} (fields: {', '.join(names)})" for k in value if k not in names]
    problems += [f"missing field {k!r}" for k in required if value.get(k) is None]
    problems += [f"{k} must be a string" for k, v in value.items() if k in names and v is not None
                 and not isinstance(v, str)]
    if problems:
        raise ValueError("; ".join(problems))
    return cls(**value)


@dataclass(frozen=True)
class WandbTarget:
    """A Weights & Biases run: its project, entity (team or user; null = the default) and display name (null =
    the raytp run's name). WANDB_MODE=offline and the other WANDB_* variables apply as usual."""
    project: str
    entity: str | None = None
    name: str | None = None

    @classmethod
    def parse(cls, value: Any) -> "WandbTarget":
        return _parse(cls, value, ("project",))


@dataclass(frozen=True)
class MlflowTarget:
    """An MLflow tracking server or store (`uri`: http://..., file:/..., databricks) and experiment name."""
    uri: str
    experiment: str = "raytp"

    @classmethod
    def parse(cls, value: Any) -> "MlflowTarget":
        return _parse(cls, value, ("uri",))
