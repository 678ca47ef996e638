"""tp_vs_dtensor: step time of raytp's tensor parallelism vs PyTorch's native one.

The same GPT (same init, same batches, same AdamW and clipping) at the same TP
degree, trained by raytp's layers (build_shard + train_step) and by
``torch.distributed.tensor.parallel`` (ColwiseParallel/RowwiseParallel on
c_attn/c_fc/c_proj, RowwiseParallel on the vocab-parallel embedding, the tied
LM head ColwiseParallel with vocab-sharded logits and ``loss_parallel``), in
one spawned process group: gloo, one thread per rank, world size = TP.

Both models live in the same processes and take turns step by step, in the
orders cycling through every permutation (after untimed warm-up steps, whose
losses are compared), so the machine's slow spells hit both alike. A step's time is the max over ranks of its wall time (the ranks start each step
at a barrier). Figures: the median step time of each and their ratio, and the
median of the ratios of neighbouring pairs of steps (less sensitive to drift).

A third model takes turns with them to show what dominates: raytp's step with
every torch.distributed collective turned into a no-op (``raytp_compute_only``):
its compute alone, the floor that neither implementation can go below; the
rest of raytp's time is its collectives (and the waits on the slower rank).
A fourth, ``raytp_no_overlap``, is raytp with ``parallel.tp_overlap`` off (each
TP entry's backward collective after the weight gradients, not behind them).
"""
from __future__ import annotations

import itertools
import os
import statistics

import torch
import torch.distributed as dist

from bench.common import (HYPER, SEED, DistApiCounter, NoCollectives, batches, build_dtensor_gpt,
                          collective_counter, corpus, dtensor_step, size, spawn, timed)
from raytp.parallel import comm
from raytp.parallel.groups import build_groups
from raytp.parallel.layers import set_tp_overlap
from raytp.parallel.layout import Layout
from raytp.models.shard import build_shard
from raytp.train.step import make_optimizer, train_step

IMPLS = ("raytp", "dtensor")  # trained side by side; their losses are compared
FLOOR = "raytp_compute_only"    # raytp with collectives as no-ops: timing only
SYNC = "raytp_no_overlap"       # raytp with parallel.tp_overlap off: the entries' collectives not hidden
TIMED = IMPLS + (FLOOR, SYNC)
PEER = "torch.distributed.tensor.parallel (DTensor, parallelize_module + loss_parallel), same GPT, gloo, 1 thread/rank"


def _rank(rank: int, world: int, init: str, quick: bool) -> dict:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    s = size(quick)
    groups = build_groups(Layout(world, dp=1), rank)
    total = s.warmup + 1 + s.timed
    data = batches(corpus(quick), s, total)

    raytp_model = build_shard(s.cfg, SEED, groups.tp)
    raytp_opt = make_optimizer(raytp_model, HYPER)
    dt_model = build_dtensor_gpt(s.cfg, world)
    dt_opt = make_optimizer(dt_model, HYPER)
    floor_model = build_shard(s.cfg, SEED, groups.tp)
    floor_opt = make_optimizer(floor_model, HYPER)
    sync_model = build_shard(s.cfg, SEED, groups.tp)
    sync_opt = make_optimizer(sync_model, HYPER)
    set_tp_overlap(raytp_model, True)
    set_tp_overlap(sync_model, False)
    set_tp_overlap(floor_model, False)  # its collectives return nothing to wait on
    next_step = {impl: 0 for impl in TIMED}

    def step(impl: str) -> float:
        i = next_step[impl]
        next_step[impl] += 1
        x, y = data[i]
        if impl == "raytp":
            return train_step(raytp_model, raytp_opt, [(x, y)], groups, i, HYPER).loss
        if impl == FLOOR:
            with NoCollectives():
                return train_step(floor_model, floor_opt, [(x, y)], groups, i, HYPER).loss
        if impl == SYNC:
            return train_step(sync_model, sync_opt, [(x, y)], groups, i, HYPER).loss
        return dtensor_step(dt_model, dt_opt, x, y, i, HYPER)

    out = {impl: {"losses": [], "times": [], "counts": {}, "bytes": {}, "dist_api_calls": {}, "comm": []}
           for impl in TIMED}
    for impl in TIMED:  # warm-up: untimed; raytp's and DTensor's losses are compared
        for _ in range(s.warmup):
            out[impl]["losses"].append(step(impl))
    for impl in IMPLS:  # one counted step each (also untimed: the counters cost time)
        with DistApiCounter() as api, collective_counter() as ops:
            out[impl]["losses"].append(step(impl))
        out[impl]["counts"], out[impl]["bytes"] = dict(ops.counts), dict(ops.bytes)
        out[impl]["dist_api_calls"] = dict(api.counts)
    orders = list(itertools.permutations(TIMED))  # each in each position equally often
    for i in range(s.timed):
        for impl in orders[i % len(orders)]:
            comm.STATS.take(), comm.STATS.take_hidden()
            seconds, loss = timed(lambda: step(impl))
            out[impl]["times"].append(seconds)
            out[impl]["losses"].append(loss)
            out[impl]["comm"].append((comm.STATS.take()[0], comm.STATS.take_hidden()))
    return out


def measure(tp: int, quick: bool) -> dict:
    ranks = spawn(tp, _rank, quick)
    fig: dict = {}
    per_step = {impl: [max(step_times) for step_times in zip(*(r[impl]["times"] for r in ranks))]
                for impl in TIMED}
    for impl in TIMED:
        fig[f"{impl}_median_step_s"] = round(statistics.median(per_step[impl]), 4)
        fig[f"{impl}_min_step_s"] = round(min(per_step[impl]), 4)
    fig["ratio_raytp_over_dtensor"] = round(fig["raytp_median_step_s"] / fig["dtensor_median_step_s"], 3)
    fig["paired_ratio_median"] = round(statistics.median(
        a / b for a, b in zip(per_step["raytp"], per_step["dtensor"])), 3)
    for impl in ("raytp", SYNC):  # rank 0's collective seconds a step: waited on, and run behind compute
        fig[f"{impl}_comm_exposed_s"] = round(statistics.median(c for c, _ in ranks[0][impl]["comm"]), 4)
        fig[f"{impl}_comm_hidden_s"] = round(statistics.median(h for _, h in ranks[0][impl]["comm"]), 4)
    fig["ratio_overlap_over_no_overlap"] = round(fig["raytp_median_step_s"] / fig[f"{SYNC}_median_step_s"], 3)
    floor = fig[f"{FLOOR}_median_step_s"]
    fig["raytp_over_floor"] = round(fig["raytp_median_step_s"] / floor, 3)
    fig["raytp_share_beyond_compute"] = round(1 - floor / fig["raytp_median_step_s"], 3)  # collectives + waits
    fig["dtensor_over_floor_s"] = round(fig["dtensor_median_step_s"] - floor, 4)
    fig["raytp_over_floor_s"] = round(fig["raytp_median_step_s"] - floor, 4)
    n_cmp = size(quick).warmup + 1
    a, b = ranks[0]["raytp"]["losses"], ranks[0]["dtensor"]["losses"]
    fig["first_losses"] = {impl: [round(v, 5) for v in ranks[0][impl]["losses"][:n_cmp]] for impl in IMPLS}
    fig["first_losses_max_abs_diff"] = float(f"{max(abs(u - v) for u, v in zip(a[:n_cmp], b[:n_cmp])):.2e}")
    fig["all_losses_max_abs_diff"] = float(f"{max(abs(u - v) for u, v in zip(a, b)):.2e}")  # rounding drifts
    fig["collectives_per_step"] = {impl: ranks[0][impl]["counts"] for impl in IMPLS}
    fig["collective_bytes_per_step"] = {impl: ranks[0][impl]["bytes"] for impl in IMPLS}
    fig["dist_api_calls_per_step"] = {impl: ranks[0][impl]["dist_api_calls"] for impl in IMPLS}
    fig["timed_steps_each"] = len(per_step["raytp"])
    return fig


def run(quick: bool = False) -> dict:
    s = size(quick)
    cores = os.cpu_count() or 1
    out: dict = {"peer": PEER, "goal": "ratio_raytp_over_dtensor <= 0.8",
                 "model": (f"GPT {s.cfg.n_layer} layers x {s.cfg.n_embd} wide, {s.cfg.n_head} heads, vocab "
                           f"{s.cfg.vocab_size}, T={s.cfg.block_size}, batch {s.batch_size}, AdamW + clip 1.0"),
                 "cpu_cores": cores, "torch": torch.__version__}
    for tp in s.tps:
        fig = measure(tp, quick)
        if tp > cores:
            fig["note"] = f"{tp} single-threaded ranks on {cores} cores: oversubscribed"
        out[f"tp{tp}"] = fig
    return out
