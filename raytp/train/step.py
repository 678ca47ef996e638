"""One optimizer step of a TP x DP shard: forward, backward, sync, clip, update.

Gradient synchronisation happens once per step, after all micro-batches:
- DP: the gradients of every parameter (plus the loss, for reporting) are
  averaged over the DP group in one flat all-reduce;
- SP: replicated parameters that saw only this rank's slice of the sequence
  (LayerNorms, row-parallel biases, position embedding; tagged
  ``sequence_parallel`` by the TP plan) have their gradients summed over TP;
- shared KV heads (grouped-query attention at tp > n_kv_head; tagged
  ``shared_head``): each rank's copy saw only its own query heads, so the
  copies of a head have their gradients summed over the ranks sharing it
  (in the same all-reduce as SP's).
Clipping uses the global norm: sharded parameters' squares are summed over
TP (a shared head's once), replicated ones counted once.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from raytp.model import set_dropout_key
from raytp.parallel import comm
from raytp.parallel.groups import ProcessGroups
from raytp.parallel.sharding import sharding_of
from raytp.seeds import derive_seed


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


def make_optimizer(model: torch.nn.Module, h: Hyper) -> torch.optim.AdamW:
    """AdamW; matrices and embeddings decay, biases and LayerNorms do not (as nanoGPT)."""
    params = list(dict(model.named_parameters()).items())
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    cuda = params[0][1].is_cuda  # fused: one kernel for the whole update on a GPU
    return torch.optim.AdamW([{"params": decay, "weight_decay": h.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=h.lr, betas=(h.beta1, h.beta2), foreach=False, fused=cuda or None)


def _flat_all_reduce(tensors: list[torch.Tensor], group, scale: float = 1.0) -> None:
    """All-reduce (sum, then * scale) a list of tensors in place, as one flat buffer."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, group)
    if scale != 1.0:
        flat *= scale
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t))


def _sum_over_tp(params: list, group) -> None:
    """Sum over TP, in one all-reduce, the gradients TP ranks each hold a part of: SP-tagged ones, and
    shared KV-head copies (each placed at its head's slot of a buffer of all heads, so the sum adds up
    the copies of each head and nothing else)."""
    sp = [p.grad for p in params if getattr(p, "sequence_parallel", False)]
    shared = []
    for p in params:
        if hasattr(p, "shared_head"):
            head, heads, _ = p.shared_head
            buf = p.grad.new_zeros((heads, *p.grad.shape))
            buf[head] = p.grad
            shared.append((p, head, buf))
    _flat_all_reduce(sp + [buf for _, _, buf in shared], group)
    for p, head, buf in shared:
        p.grad.copy_(buf[head])


def global_grad_norm(model: torch.nn.Module, groups: ProcessGroups) -> torch.Tensor:
    sharded, replicated = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            sq = p.grad.float().pow(2).sum()
            if hasattr(p, "shared_head"):
                sharded.append(sq / p.shared_head[2])  # held by that many ranks: counted once in the sum
            elif sharding_of(name, model.cfg).dim is not None:
                sharded.append(sq)
            else:
                replicated.append(sq)
    zero = torch.zeros((), device=next(model.parameters()).device)
    sq_sharded = torch.stack(sharded).sum() if sharded else zero
    if groups.tp is not None:
        comm.all_reduce(sq_sharded, groups.tp)
    sq_replicated = torch.stack(replicated).sum() if replicated else zero
    return (sq_sharded + sq_replicated).sqrt()


@dataclass
class StepResult:
    loss: float        # mean loss over the global batch
    grad_norm: float   # before clipping
    lr: float


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches, groups: ProcessGroups,
               step: int, h: Hyper, before_update=None) -> StepResult:
    """One optimizer step over this rank's micro-batches [(x, y), ...] of global step `step`.
    `before_update`: called right before the weights and optimizer state change (the optimizer's
    step); until then they are only read, so a snapshot of them may still be being copied."""
    model.train()
    optimizer.zero_grad(set_to_none=False)  # the same buffers every step: no allocator churn
    n = len(micro_batches)
    loss_sum = torch.zeros((), device=next(model.parameters()).device)
    for i, (x, y) in enumerate(micro_batches):
        set_dropout_key(model, derive_seed(h.seed, step, groups.dp_rank * n + i))
        with compute_precision(h, x.device):
            loss = model(x, y)
        (loss / n).backward()
        loss_sum += loss.detach()
    params = [p for p in model.parameters() if p.grad is not None]

    if groups.tp is not None:
        _sum_over_tp(params, groups.tp)
    mean_loss = (loss_sum / n).reshape(1)
    if groups.dp is not None:
        dp = groups.layout.dp
        _flat_all_reduce([p.grad for p in params] + [mean_loss], groups.dp, scale=1.0 / dp)

    norm = global_grad_norm(model, groups)
    if h.grad_clip > 0:
        coef = torch.clamp(h.grad_clip / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
    lr = lr_at(step, h)
    for g in optimizer.param_groups:
        g["lr"] = lr
    if before_update is not None:
        before_update()
    optimizer.step()
    return StepResult(float(mean_loss), float(norm), lr)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, micro_batches, groups: ProcessGroups, h: Hyper | None = None) -> float:
    """Mean loss over this rank's batches, averaged over DP (in the precision of `h`, if given)."""
    model.eval()
    with compute_precision(h or Hyper(), micro_batches[0][0].device):
        total = torch.stack([model(x, y).float() for x, y in micro_batches]).mean().reshape(1)
    if groups.dp is not None:
        comm.all_reduce(total, groups.dp)
        total /= groups.layout.dp
    model.train()
    return float(total)
