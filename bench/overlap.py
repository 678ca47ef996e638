"""overlap: the DP gradient reduction overlapping the backward pass (``parallel.overlap_grad_reduce``).

At DP = 2 (gloo, one thread per rank), the same GPT on the same batches, two micro-batches a step, taking
turns step by step after untimed warm-up steps (a step's time is the slowest rank's; every rank starts it at
a barrier): raytp zero 0 and zero 1, each with its buckets reduced after the backward pass and during it
(zero 1 with overlap also gathers its new weights during the next forward pass),
against PyTorch DDP (which overlaps its bucketed all-reduce with the backward pass, ``no_sync`` on the first
micro-batch, the same bucket size). The buckets are 1M elements (the model has ~9M), so the backward pass
has several to reduce while it runs; a job's default is Megatron's 40M.

Figures: median step times and ratios; the time each raytp step spends on its DP reduction after the
backward pass (raytp.train.grad_buckets ``finish_s``: launching what is left and waiting for every bucket)
with and without overlap, and from them the share of the DP reduction that overlap hides (1 - exposed with
overlap / all of it without); the buckets reduced from the backward pass; and whether every loss is the
same to the bit with and without overlap.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from bench.common import HYPER, SEED, spawn, timed, torch_adamw
from raytp.models.args import ModelArgs
from raytp.models.registry import build_model
from raytp.models.shard import build_shard
from raytp.parallel.groups import build_groups
from raytp.parallel.layout import Layout
from raytp.train.hyper import lr_at
from raytp.train.optimizer import make_optimizer
from raytp.train.step import train_step

PEER = "PyTorch DDP (bucketed all-reduce overlapped with the backward pass, gloo), torch's AdamW, clip_grad_norm_"
FULL = {"cfg": ModelArgs(n_layer=4, n_head=8, n_embd=384, block_size=128, vocab_size=4096, dropout=0.0),
        "batch": 4, "micro": 2, "warmup": 2, "timed": 10, "bucket": 1_000_000}
QUICK = {"cfg": ModelArgs(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256, dropout=0.0),
         "batch": 2, "micro": 2, "warmup": 1, "timed": 2, "bucket": 2_000}
IMPLS = ("zero0", "zero0_overlap", "zero1", "zero1_overlap", "ddp")


def _micro_batches(p: dict, step: int, rank: int, dp: int):
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    x = torch.randint(0, p["cfg"].vocab_size, (p["batch"] * dp, p["cfg"].block_size), generator=g)
    x = x[rank * p["batch"]:(rank + 1) * p["batch"]]
    return list(zip(x.chunk(p["micro"]), torch.roll(x, -1, 1).chunk(p["micro"])))


def _ddp(p: dict, world: int):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(build_model(p["cfg"], SEED), bucket_cap_mb=p["bucket"] * 4 / 2**20,
                                    gradient_as_bucket_view=True)
    return model, torch_adamw(model)


def _ddp_step(model, opt, micro, step) -> float:
    opt.zero_grad(set_to_none=False)
    total = 0.0
    for k, (x, y) in enumerate(micro):
        if k < len(micro) - 1:
            with model.no_sync():
                loss = model(x, y) / len(micro)
                loss.backward()
        else:
            loss = model(x, y) / len(micro)
            loss.backward()
        total += float(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), HYPER.grad_clip)
    for g in opt.param_groups:
        g["lr"] = lr_at(step, HYPER)
    opt.step()
    out = torch.tensor([total])
    dist.all_reduce(out)
    return float(out) / dist.get_world_size()


def _rank(rank, world, init, p):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sides = {}
    for impl in IMPLS[:4]:
        zero, overlap = int(impl[4]), impl.endswith("overlap")
        groups = build_groups(Layout(1, dp=world, zero=zero), rank)
        model = build_shard(p["cfg"], SEED, None, False)
        opt = make_optimizer(model, HYPER, world, rank, zero, p["bucket"], overlap, overlap_gather=overlap and zero)
        sides[impl] = (model, opt, groups)
    sides["ddp"] = (*_ddp(p, world), None)

    def one(impl, step):
        model, opt, groups = sides[impl]
        micro = _micro_batches(p, step, rank, world)
        if impl == "ddp":
            return _ddp_step(model, opt, micro, step), 0.0
        loss = train_step(model, opt, micro, groups, step, HYPER).loss
        return loss, opt.grads.finish_s

    times, losses, waits = ({k: [] for k in IMPLS} for _ in range(3))
    for step in range(p["warmup"] + p["timed"]):
        order = IMPLS[step % len(IMPLS):] + IMPLS[:step % len(IMPLS)]  # rotate who goes first
        for impl in order:
            t, (loss, wait) = timed(lambda: one(impl, step))
            losses[impl].append(loss)
            if step >= p["warmup"]:
                times[impl].append(t)
                waits[impl].append(wait)
    early = {impl: sides[impl][1].grads.early for impl in IMPLS[:4]}
    return {"times": times, "losses": losses, "waits": waits, "early": early,
            "buckets": len(sides["zero0"][1].buckets)}


def run(quick: bool = False) -> dict:
    p = QUICK if quick else FULL
    ranks = spawn(2, _rank, p)
    n = p["timed"]
    med = {impl: statistics.median(max(r["times"][impl][i] for r in ranks) for i in range(n)) for impl in IMPLS}
    wait = {impl: statistics.median(max(r["waits"][impl][i] for r in ranks) for i in range(n)) for impl in IMPLS[:4]}
    losses = ranks[0]["losses"]
    out = {"peer": PEER, "quick": quick, "goal": "hide the DP reduction behind the backward pass; no bit changes",
           "model": f"GPT {p['cfg'].n_layer}L x {p['cfg'].n_embd} wide, vocab {p['cfg'].vocab_size}, "
                    f"T={p['cfg'].block_size}, {p['batch']} sequences per rank in {p['micro']} micro-batches, fp32",
           "dp": 2, "bucket_elements": p["bucket"], "buckets": ranks[0]["buckets"], "cpu_cores": 2,
           "torch": torch.__version__,
           **{f"{impl}_median_step_s": round(med[impl], 4) for impl in IMPLS},
           **{f"{impl}_dp_reduction_after_backward_s": round(wait[impl], 4) for impl in IMPLS[:4]},
           "buckets_reduced_during_backward": {impl: min(r["early"][impl] for r in ranks) for impl in IMPLS[:4]},
           "losses_equal_with_and_without_overlap": losses["zero0"] == losses["zero0_overlap"] == losses["zero1"]
           == losses["zero1_overlap"]}
    for zero in ("zero0", "zero1"):
        out[f"{zero}_ratio_overlap_over_not"] = round(med[f"{zero}_overlap"] / med[zero], 3)
        out[f"{zero}_overlap_over_ddp"] = round(med[f"{zero}_overlap"] / med["ddp"], 3)
        out[f"{zero}_share_of_dp_reduction_hidden"] = round(1 - wait[f"{zero}_overlap"] / wait[zero], 3)
    return out
