"""snapshots: what raytp's per-step in-memory snapshots cost a training step.

The same raytp job (TP=2, jobs/default.yaml's model: 4 layers x 128 wide, 4
heads, block 128, batch 8, builtin data, 1 thread/rank, no evaluation, no
checkpoints) under raytp's ``Driver`` with ``recovery.snapshot_every=1``
("snap": after every step each rank of DP replica 0 packs a copy of its
weights and AdamW state into one buffer, between two steps, and its Ray
streaming generator yields it -- the write into the object store -- while the
next step runs, so the driver owns it) and ``=0`` ("nosnap"). The machine is shared and its speed drifts by tens of percent
within a minute, so the two settings alternate call by call inside one job:
after ``warmup`` steps, calls of ``spc`` steps (one streamed call each, the
driver's own ``train_loop``) switch the setting in the order ABBA ABBA ...
(the setting is read from the driver's job at each call and passed to the
workers, so switching it between calls is what a job with that setting does).
``runs`` fresh jobs, the first starting with snap, the next with nosnap.

Figures, medians over calls:
- wall seconds per step: a call's time as the caller sees it / its steps;
  includes the snapshot copy, its trip into the object store and the driver
  taking the reference. ``overhead_wall_paired_median``: the median over
  adjacent (snap, nosnap) call pairs of their ratio, minus 1; the goal is on it.
- ``step_time_s`` from metrics.jsonl (the slowest rank's time inside
  ``Worker._step``: forward, backward, optimizer). The snapshot is taken after
  that timer stops, so this shows only its side effects on the step itself.

With TP=2 and one thread per rank both cores of a 2-core machine train, so
the write competes with training for CPU. The same comparison runs again at
TP=1 (``tp1_free_core_*``): one core trains and the other is free for the
write, as the CPU cores of a GPU node are while its GPU runs the step.

Also reported: the bytes of one snapshot (one TP=2 shard, weights + AdamW),
the round trip of ``Worker.get_state`` on a live rank (the same copy, returned
through the object store), the absolute wall overhead per step, and, timed in
this process on the TP=1 model, the packed copy and ``ray.put`` of it, also
scaled by bytes to one TP=2 shard (``est_*_per_rank``): what the copy and the
object-store write each cost.

This module also holds what bench.recovery and bench.resize share (job dicts,
an embedded Ray, a Driver, reading the run directory).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PEER = "the same raytp job (TP=2, same embedded Ray, fresh actors each run) with recovery.snapshot_every=0"
GOAL = 0.03
MODEL = {"FULL": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 256},
         "QUICK": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32, "vocab_size": 256}}
FULL = {"model": MODEL["FULL"], "batch_size": 8, "warmup": 5, "spc": 10, "calls": 16, "runs": 2}
QUICK = {"model": MODEL["QUICK"], "batch_size": 4, "warmup": 2, "spc": 3, "calls": 4, "runs": 1}


# ---------------------------------------------------------------- shared by the recovery/resize benchmarks

def job(model: dict, batch_size: int, tp: int, dp: int, steps: int, **sections) -> dict:
    """A raytp job as a dict for raytp.config.from_dict: no evaluation, no checkpoints unless given."""
    d = {"model": {**model, "dropout": 0.0}, "parallel": {"tp": tp, "dp": dp},
         "train": {"steps": steps, "batch_size": batch_size, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2,
                   "eval_interval": 0, "steps_per_call": 10, "seed": 1337},
         "data": {"source": "builtin"}, "checkpoint": {"every": 0},
         "runtime": {"device": "cpu", "threads_per_worker": 1, "placement_timeout_s": 60.0}}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return d


@contextlib.contextmanager
def ray_session(num_cpus: int = 8):
    """An embedded Ray on loopback, shut down at the end."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray's import: loopback only
    import ray
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace="raytp", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def driver(job_dict: dict, run_dir: Path, init_state=None):
    """raytp's Driver for a job dict, its run named after the run directory, quiet."""
    from raytp.config import from_dict
    from raytp.runtime.driver.driver import Driver
    return Driver(from_dict(job_dict), run_dir, run_dir.name, out=io.StringIO(), init_state=init_state)


def close(d) -> None:
    d.release()
    d.log.close()


def warm_up(p: dict, tp: int, dp: int, run_dir: Path) -> None:
    """One untimed job (start, two steps): a fresh Ray's first actors start much slower (up to 20 s seen)."""
    driver(job(p["model"], p["batch_size"], tp, dp, 2), run_dir).run_to_end()  # releases at the end


def jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in open(path) if line.strip()]
    except FileNotFoundError:
        return []


def med(xs) -> float:
    return round(statistics.median(xs), 4)


def say(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the benchmark

def one_run(p: dict, first: int, run_dir: Path, tp: int = 2, on: int | None = 1) -> list[dict]:
    """One fresh job; after the warm-up, calls of `spc` steps alternate snapshots on (recovery.snapshot_every
    = `on`: 1, every step; None, the runtime's choice within the budget) and off (0) as ABBA, starting
    with on if `first`. Returns one dict per timed call."""
    import dataclasses
    import ray
    jd = job(p["model"], p["batch_size"], tp, 1, p["warmup"] + p["calls"] * p["spc"] + 1,
             train={"steps_per_call": p["spc"]}, recovery={"snapshot_every": on if first else 0})
    d = driver(jd, run_dir)
    calls = []
    try:
        d.start()
        d.train_loop(until=p["warmup"])
        for i in range(p["calls"]):
            snap = bool(first) if i % 4 in (0, 3) else not first
            cfg = dataclasses.replace(d.cfg, recovery=dataclasses.replace(d.cfg.recovery,
                                                                          snapshot_every=on if snap else 0))
            d.changes.adopt(dataclasses.replace(d.group, cfg=cfg))
            start = d.step
            t0 = time.perf_counter()
            d.train_loop(until=start + p["spc"])  # one streamed call of spc steps (the driver's code path)
            calls.append({"snap": snap, "wall_per_step_s": (time.perf_counter() - t0) / p["spc"], "start": start})
        t0 = time.perf_counter()
        state = ray.get(d.group.workers[0].get_state.remote())  # one snapshot's worth, through the object store
        get_state_s = time.perf_counter() - t0
    finally:
        close(d)
    steps = {m["step"]: m["step_time_s"] for m in jsonl(run_dir / "metrics.jsonl")}
    nbytes = sum(t.numel() * t.element_size() for part in state.values() for v in part.values()
                 for t in (v.values() if isinstance(v, dict) else [v]))
    for c in calls:
        c["step_time_s"] = statistics.median(steps[s] for s in range(c["start"], c["start"] + p["spc"]))
        c["get_state_s"], c["snapshot_bytes"] = get_state_s, nbytes
    return calls


def shard_state_cost(p: dict, reps: int = 5) -> dict:
    """shard_state (the copy a snapshot makes) and ray.put of it, on the full TP=1 model (about twice
    the bytes of a TP=2 shard), in this process."""
    import ray
    import torch
    from raytp.models.args import ModelArgs
    from raytp.models.gpt2.model import GPT
    from raytp.train.shard_state import pack_state, shard_state
    from raytp.train.hyper import Hyper
    from raytp.train.step import make_optimizer
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = ModelArgs(**p["model"], dropout=0.0)
    model = GPT(cfg)
    opt = make_optimizer(model, Hyper())
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    model(x, x).backward()
    opt.step()
    copy, put = [], []
    for _ in range(reps):  # what Worker.run_steps does: the packed copy, then its write to the object store
        t0 = time.perf_counter()
        packed = pack_state(shard_state(model, opt, copy=False))
        t1 = time.perf_counter()
        ref = ray.put(packed)
        copy.append(t1 - t0)
        put.append(time.perf_counter() - t1)
        del ref
    nbytes = packed["data"].nbytes
    return {"tp1_shard_state_s": med(copy), "tp1_ray_put_s": med(put), "tp1_bytes": nbytes}


def paired_overhead(calls: list[dict]) -> float:
    """Median over adjacent (snap, nosnap) calls of the same run of their wall-time ratio, minus 1:
    the drift of the shared machine cancels."""
    pairs = [(calls[i], calls[i + 1]) for i in range(0, len(calls) - 1, 2) if calls[i]["snap"] != calls[i + 1]["snap"]]
    ratios = [(x if x["snap"] else y)["wall_per_step_s"] / (y if x["snap"] else x)["wall_per_step_s"] for x, y in pairs]
    return round(statistics.median(ratios) - 1, 4)


def run(quick: bool = False) -> dict:
    p = QUICK if quick else FULL
    calls: list[dict] = []
    tp1: list[dict] = []
    with ray_session(4) as _, tempfile.TemporaryDirectory(prefix="raytp-bench-snap-") as tmp:
        for i in range(p["runs"]):
            calls += one_run(p, 1 - i % 2, Path(tmp) / f"snapshots-{os.getpid()}-{i}")
            say(f"snapshots: run {i + 1}/{p['runs']} done")
        for i in range(p["runs"]):  # one core trains, the other is free for the write, as on a GPU node
            tp1 += one_run(p, 1 - i % 2, Path(tmp) / f"snapshots-tp1-{os.getpid()}-{i}", tp=1)
            say(f"snapshots: TP=1 run {i + 1}/{p['runs']} done")
        budget: list[dict] = []
        for i in range(p["runs"]):  # the default: the runtime's interval, within recovery.snapshot_budget
            budget += one_run(p, 1 - i % 2, Path(tmp) / f"snapshots-budget-{os.getpid()}-{i}", on=None)
            say(f"snapshots: budget run {i + 1}/{p['runs']} done")
        chosen = [e["every"] for i in range(p["runs"]) for e in jsonl(Path(tmp) / f"snapshots-budget-{os.getpid()}-{i}"
                                                                  / "events.jsonl") if e["kind"] == "snapshot_interval" and not e["pinned"]]
        cost = shard_state_cost(p)
    on, off = [c for c in calls if c["snap"]], [c for c in calls if not c["snap"]]
    m = p["model"]
    fig: dict = {"peer": PEER,
                 "job": f"TP=2, GPT {m['n_layer']}L x {m['n_embd']} wide, {m['n_head']} heads, block "
                        f"{m['block_size']}, batch {p['batch_size']}, steps_per_call {p['spc']}, 1 thread/rank",
                 "runs": p["runs"], "calls_each": len(on), "steps_per_call": p["spc"],
                 "order_per_run": "ABBA ABBA ... (A = the run's first setting, alternating between runs)"}
    for key in ("wall_per_step_s", "step_time_s"):
        a, b = med([c[key] for c in on]), med([c[key] for c in off])
        fig[f"snap_{key}"], fig[f"nosnap_{key}"] = a, b
        fig[f"overhead_{key}"] = round(a / b - 1, 4)
    fig["overhead_wall_paired_median"] = paired_overhead(calls)
    fig["tp1_free_core_overhead_wall_paired_median"] = paired_overhead(tp1)
    fig["tp1_free_core_snapshot_bytes"] = tp1[0]["snapshot_bytes"]
    fig["snapshot_bytes_per_rank"] = calls[0]["snapshot_bytes"]
    fig["get_state_roundtrip_s"] = med([c["get_state_s"] for c in calls])
    fig["overhead_wall_s_per_step"] = round(fig["snap_wall_per_step_s"] - fig["nosnap_wall_per_step_s"], 4)
    fig.update(cost)
    scale = calls[0]["snapshot_bytes"] / cost["tp1_bytes"]  # the TP=1 timings scaled to one TP=2 shard
    fig["est_shard_state_s_per_rank"] = round(cost["tp1_shard_state_s"] * scale, 4)
    fig["est_ray_put_s_per_rank"] = round(cost["tp1_ray_put_s"] * scale, 4)
    fig["budget_overhead_wall_paired_median"] = paired_overhead(budget)
    fig["budget_intervals_chosen"] = chosen
    fig["method"] = ("overhead = median over adjacent (on, off) calls of one job of their wall time per step's "
                     "ratio, minus 1 (bench/ray_overhead's snapshot_overhead is the same ratio across its rounds)")
    fig["goal"] = (f"overhead of the wall time per step with the default budget (paired median, TP=2: both cores "
                   f"training) <= {GOAL:.0%}")
    fig["goal_met"] = fig["budget_overhead_wall_paired_median"] <= GOAL
    return fig
