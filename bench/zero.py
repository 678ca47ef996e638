"""zero: the distributed optimizer (``parallel.zero: 1``) against the replicated one and PyTorch FSDP2.

Memory (issue 20, "Performance and memory"): per DP rank, the bytes of parameters + gradients (or, under
zero 1, the bucket buffers that replace them) + AdamW state held at the update of a step (each storage
counted once, bench.memory.held_bytes), at DP = 2, 4, 8 (a small
model, one process per rank, gloo), at zero 0 and zero 1, against 16 and 8 + 8/dp bytes a parameter
(AdamW's step counts make it a little more); and each worker process's peak resident memory
(ru_maxrss), zero 0 against zero 1.

Step time at DP = 2 (gloo, one thread per rank): raytp zero 0, raytp zero 1 and FSDP2 (``fully_shard`` per
block and at the root, ``reshard_after_forward=False``, torch's AdamW, ``clip_grad_norm_``) train the same
GPT on the same batches in one process group, taking turns step by step after untimed warm-up steps; a
step's time is the slowest rank's (every rank starts it at a barrier). Figures: median step times, their
ratios, every step's loss, and the bytes per rank each keeps.
"""
from __future__ import annotations

import resource
import statistics

import torch
import torch.distributed as dist

from bench.common import HYPER, SEED, spawn, timed, torch_adamw
from bench.memory import held_bytes
from raytp.models.args import ModelArgs
from raytp.models.registry import build_model
from raytp.models.shard import build_shard
from raytp.parallel.groups import build_groups
from raytp.parallel.layout import Layout
from raytp.train.hyper import lr_at
from raytp.train.optimizer import make_optimizer
from raytp.train.step import train_step

PEER = ("PyTorch FSDP2 (fully_shard per block and root, reshard_after_forward=False, gloo) with torch's AdamW and "
        "clip_grad_norm_; and raytp's own replicated optimizer (zero 0)")
FULL = {"cfg": ModelArgs(n_layer=4, n_head=8, n_embd=384, block_size=128, vocab_size=4096, dropout=0.0),
        "batch": 4, "warmup": 2, "timed": 10, "dps": (2, 4, 8), "mem_steps": 2}
QUICK = {"cfg": ModelArgs(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256, dropout=0.0),
         "batch": 2, "warmup": 1, "timed": 2, "dps": (2, 4), "mem_steps": 1}
IMPLS = ("zero0", "zero1", "fsdp2")


def _batch(p: dict, step: int, rank: int, dp: int):
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    x = torch.randint(0, p["cfg"].vocab_size, (p["batch"] * dp, p["cfg"].block_size), generator=g)
    x = x[rank * p["batch"]:(rank + 1) * p["batch"]]
    return x, torch.roll(x, -1, 1)


def _memory_rank(rank, world, init, p, zero):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = build_groups(Layout(1, dp=world, zero=zero), rank)
    model = build_shard(p["cfg"], SEED, None, False)
    opt = make_optimizer(model, HYPER, world, rank, zero)
    held = {}
    for step in range(p["mem_steps"]):  # held at the update: gradients (or their buffers) and state all alive
        train_step(model, opt, [_batch(p, step, rank, world)], groups, step, HYPER,
                   before_update=lambda: held.update(held_bytes(model, opt)))
    return {"held": held, "params": sum(q.numel() for q in model.parameters()),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _fsdp2(cfg: ModelArgs, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = build_model(cfg, SEED)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks(range(cfg.n_layer)):
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model, torch_adamw(model)


def _fsdp2_step(model, opt, x, y, step) -> float:
    opt.zero_grad(set_to_none=False)
    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), HYPER.grad_clip)
    for g in opt.param_groups:
        g["lr"] = lr_at(step, HYPER)
    opt.step()
    out = loss.detach().reshape(1)
    dist.all_reduce(out)
    return float(out) / dist.get_world_size()


def _local_bytes(model, opt) -> int:
    """Bytes of a DTensor model's local parameters, gradients and optimizer state."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    tensors = [local(q) for q in model.parameters()] + [local(q.grad) for q in model.parameters() if q.grad is not None]
    tensors += [local(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _step_rank(rank, world, init, p):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cfg = p["cfg"]
    sides = {}
    for zero in (0, 1):
        groups = build_groups(Layout(1, dp=world, zero=zero), rank)
        model = build_shard(cfg, SEED, None, False)
        sides[f"zero{zero}"] = (model, make_optimizer(model, HYPER, world, rank, zero), groups)
    sides["fsdp2"] = (*_fsdp2(cfg, world), None)

    held = {}

    def one(impl, step):
        model, opt, groups = sides[impl]
        x, y = _batch(p, step, rank, world)
        if impl == "fsdp2":
            return _fsdp2_step(model, opt, x, y, step)
        return train_step(model, opt, [(x, y)], groups, step, HYPER,
                          before_update=lambda: held.update({impl: held_bytes(model, opt)["total"]})).loss

    times = {k: [] for k in IMPLS}
    losses = {k: [] for k in IMPLS}
    for step in range(p["warmup"] + p["timed"]):
        order = IMPLS[step % 3:] + IMPLS[:step % 3]  # rotate who goes first
        for impl in order:
            t, loss = timed(lambda: one(impl, step))
            losses[impl].append(loss)
            if step >= p["warmup"]:
                times[impl].append(t)
    held["fsdp2"] = _local_bytes(*sides["fsdp2"][:2])
    return {"times": times, "losses": losses, "held": held}


def run(quick: bool = False) -> dict:
    p = QUICK if quick else FULL
    out: dict = {"peer": PEER, "quick": quick,
                 "goal": "bytes within 5% of 8 + 8/dp per parameter; step <= 1.1x zero 0; <= 1.0x FSDP2",
                 "model": f"GPT {p['cfg'].n_layer}L x {p['cfg'].n_embd} wide, vocab {p['cfg'].vocab_size}, "
                          f"T={p['cfg'].block_size}, {p['batch']} sequences per rank, fp32, AdamW + clip",
                 "cpu_cores": 2, "torch": torch.__version__}
    memory = {}
    for dp in p["dps"]:
        row = {}
        for zero in (0, 1):
            ranks = spawn(dp, _memory_rank, p, zero)
            worst = max(ranks, key=lambda r: r["held"]["total"])
            n = worst["params"]
            row[f"zero{zero}_bytes_per_param"] = round(worst["held"]["total"] / n, 3)
            row[f"zero{zero}_peak_rss_mb"] = round(max(r["peak_rss"] for r in ranks) / 2**20, 1)
        row["ideal_zero1"] = 8 + 8 / dp
        row["ratio_zero1_over_ideal"] = round(row["zero1_bytes_per_param"] / row["ideal_zero1"], 4)
        row["ratio_zero0_over_16"] = round(row["zero0_bytes_per_param"] / 16, 4)
        memory[f"dp{dp}"] = row
    out["memory"] = memory
    ranks = spawn(2, _step_rank, p)
    steps = [max(r["times"][impl][i] for r in ranks) for impl in IMPLS for i in range(p["timed"])]
    med = {impl: statistics.median(steps[k * p["timed"]:(k + 1) * p["timed"]]) for k, impl in enumerate(IMPLS)}
    losses = ranks[0]["losses"]
    out["dp2_step"] = {
        **{f"{impl}_median_step_s": round(med[impl], 4) for impl in IMPLS},
        "ratio_zero1_over_zero0": round(med["zero1"] / med["zero0"], 3),
        "ratio_zero1_over_fsdp2": round(med["zero1"] / med["fsdp2"], 3),
        "losses_zero1_equal_zero0": losses["zero1"] == losses["zero0"],
        "loss_max_rel_diff_fsdp2": max(abs(a - b) / abs(b) for a, b in zip(losses["fsdp2"], losses["zero0"])),
        "bytes_per_rank": {impl: max(r["held"][impl] for r in ranks) for impl in IMPLS},
        "note": "FSDP2 also shards the weights and gradients at rest (ZeRO-3); zero 1 shards AdamW state only",
    }
    out["overlap"] = "measured by bench/overlap (these steps reduce after the backward pass: one bucket)"
    return out
