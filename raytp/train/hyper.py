"""The optimisation knobs of a step (filled from the job's train section), the LR schedule and precision."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch


@dataclass
class Hyper:
    """The optimisation knobs a step needs (filled from the job's train section)."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 0
    steps: int = 1
    lr_schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1337
    precision: str = "fp32"  # or "bf16": autocast compute, float32 masters (see compute_precision)


def compute_precision(h: Hyper, device: torch.device):
    """The context a forward runs in: nothing for fp32; for bf16, autocast to bfloat16 (matmuls and
    attention in bf16; parameters, their gradients and AdamW state stay float32, the masters)."""
    if h.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def lr_at(step: int, h: Hyper) -> float:
    """Linear warmup to h.lr over warmup_steps, then cosine to min_lr at h.steps (or constant)."""
    if step < h.warmup_steps:
        return h.lr * (step + 1) / h.warmup_steps
    if h.lr_schedule == "constant":
        return h.lr
    progress = min((step - h.warmup_steps) / max(h.steps - h.warmup_steps, 1), 1.0)
    return h.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (h.lr - h.min_lr)
