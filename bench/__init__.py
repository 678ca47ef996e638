"""Benchmarks of raytp against a peer measured in the same run.

A benchmark is a callable ``fn(quick: bool = False) -> dict`` of figures; the
dict must hold ``"peer"``, naming what raytp was compared with. ``BENCHMARKS``
maps names to such callables; registering one is one line below (``lazy`` keeps
``python -m bench NAME`` from importing the other benchmarks' modules).
``python -m bench [NAME ...] [--quick] [--out FILE]`` runs them (see __main__).
"""
from __future__ import annotations

import importlib
from typing import Callable


def lazy(target: str) -> Callable[..., dict]:
    """A callable for "package.module:function" that imports it on first call."""
    module, _, attr = target.partition(":")

    def call(*args, **kwargs) -> dict:
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__name__, call.__qualname__, call.target = attr, target, target
    return call


BENCHMARKS: dict[str, Callable[..., dict]] = {
    "tp_vs_dtensor": lazy("bench.tp_vs_dtensor:run"),
    "tp_memory": lazy("bench.memory:run"),
    "ray_overhead": lazy("bench.ray_overhead:run"),
    "checkpoint_io": lazy("bench.checkpoint_io:run"),
    "recovery": lazy("bench.recovery:run"),
    "drain": lazy("bench.drain:run"),
    "client_killed": lazy("bench.client_killed:run"),
    "snapshots": lazy("bench.snapshots:run"),
    "resize": lazy("bench.resize:run"),
    "memory_scale": lazy("bench.memory_scale:run"),
    "llama_tp": lazy("bench.llama_tp:run"),
    "driver_scale": lazy("bench.driver_scale:run"),
    "pipeline": lazy("bench.pipeline:run"),
    "prepare_chat": lazy("bench.prepare_chat:run"),
    "context_parallel": lazy("bench.context_parallel:run"),
    "zero": lazy("bench.zero:run"),
    "move_plan": lazy("bench.move_plan:run"),
    "overlap": lazy("bench.overlap:run"),
    "prepare": lazy("bench.prepare:run"),
    "moe": lazy("bench.moe:run"),
    "data_time": lazy("bench.data_time:run"),
}
