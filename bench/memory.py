"""tp_memory: bytes of parameters + gradients + AdamW state held per rank.

raytp's shard at each TP degree against the ideal: every tensor that can be
split divided by tp, plus what must stay whole on every rank (LayerNorms, the
row-parallel layers' biases, the position embedding, and AdamW's per-tensor
step counters). The ideal is computed from the one-device model's names here,
not from raytp's sharding table, so replicating something that could be split
shows up. Bytes are those of the tensors' storages, counted once per storage
(a tied weight or a view holding a bigger buffer is seen as it is held).
The DTensor peer's figure (its local shards) is reported for reference.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from bench.common import HYPER, SEED, batches, build_dtensor_gpt, corpus, dtensor_step, size, spawn
from raytp.models.gpt2.model import GPT
from raytp.parallel.groups import build_groups
from raytp.parallel.layout import Layout
from raytp.models.shard import build_shard
from raytp.train.step import make_optimizer, train_step

PEER = "ideal (split tensors / tp + replicated ones); DTensor model's bytes for reference"
MUST_REPLICATE = re.compile(r"wpe\.weight|(h\.\d+\.)?ln_(1|2|f)\.(weight|bias)|h\.\d+\.(attn|mlp)\.c_proj\.bias")
KINDS = ("params", "grads", "optimizer")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Storage bytes of params, grads and optimizer state on this rank (each storage once). The grads include
    the distributed optimizer's bucket buffers while it holds them (from the reduce to the update, where its
    parameters' ``.grad`` are dropped: raytp.train.grad_buckets)."""
    groups = {
        "params": [p for p in model.parameters()],
        "grads": [p.grad for p in model.parameters() if p.grad is not None] + list(getattr(optimizer, "held_buffers", list)()),
        "optimizer": [v for st in optimizer.named_state().values() for v in st.values() if isinstance(v, torch.Tensor)],
    }
    out, seen = {}, set()
    for kind, tensors in groups.items():
        total = 0
        for t in tensors:
            st = _local(t).untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        out[kind] = total
    out["total"] = sum(out[k] for k in KINDS)
    return out


def ideal_bytes(cfg, tp: int) -> dict[str, float]:
    """Per-rank bytes with perfect splitting: split tensors / tp, must-replicate ones whole."""
    model = GPT(cfg)
    split = replicated = 0
    n_tensors = 0
    for name, p in model.named_parameters():  # the tied head appears once
        b = p.numel() * p.element_size()
        n_tensors += 1
        if MUST_REPLICATE.fullmatch(name):
            replicated += b
        else:
            split += b
    per_copy = split / tp + replicated  # one copy of the weights (params, grads, each AdamW moment)
    step_counters = n_tensors * torch.tensor(0.0).element_size()  # AdamW's per-tensor step: replicated
    out = {"params": per_copy, "grads": per_copy, "optimizer": 2 * per_copy + step_counters}
    out["total"] = sum(out[k] for k in KINDS)
    out["replicated_share"] = (replicated * 4 + step_counters) / out["total"]
    return out


def _rank(rank: int, world: int, init: str, quick: bool) -> dict:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    s = size(quick)
    groups = build_groups(Layout(world, dp=1), rank)
    x, y = batches(corpus(quick=True), s, 1)[0]
    x, y = x[:2], y[:2]  # the bytes measured do not depend on the batch

    model = build_shard(s.cfg, SEED, groups.tp)
    opt = make_optimizer(model, HYPER)
    train_step(model, opt, [(x, y)], groups, 0, HYPER)
    raytp = held_bytes(model, opt)

    dt_model = build_dtensor_gpt(s.cfg, world)
    dt_opt = make_optimizer(dt_model, HYPER)
    dtensor_step(dt_model, dt_opt, x, y, 0, HYPER)
    return {"raytp": raytp, "dtensor": held_bytes(dt_model, dt_opt)}


def run(quick: bool = False) -> dict:
    s = size(quick)
    out: dict = {"peer": PEER, "goal": "ratio_raytp_over_ideal <= 1.05"}
    for tp in (2,) if quick else (2, 4):
        ranks = spawn(tp, _rank, quick)
        worst = {impl: max(ranks, key=lambda r: r[impl]["total"])[impl] for impl in ("raytp", "dtensor")}
        ideal = ideal_bytes(s.cfg, tp)
        out[f"tp{tp}"] = {
            "raytp_bytes": worst["raytp"]["total"],
            "ideal_bytes": round(ideal["total"]),
            "dtensor_bytes": worst["dtensor"]["total"],
            "ratio_raytp_over_ideal": round(worst["raytp"]["total"] / ideal["total"], 4),
            "ratio_dtensor_over_ideal": round(worst["dtensor"]["total"] / ideal["total"], 4),
            "raytp_breakdown": {k: worst["raytp"][k] for k in KINDS},
            "ideal_breakdown": {k: round(ideal[k]) for k in KINDS},
            "replicated_share_of_ideal": round(ideal["replicated_share"], 4),
            "full_model_bytes": round(ideal_bytes(s.cfg, 1)["total"]),
        }
    return out
