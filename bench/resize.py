"""resize: seconds from a resize request to the next completed step, in memory vs stop-and-restart.

The same raytp job (jobs/default.yaml's model: 4 layers x 128 wide, 4 heads,
block 128, batch 8, builtin data, 1 thread/rank; snapshots on, as by default)
runs under raytp's ``Driver`` on one embedded Ray (loopback, 8 CPUs, room for
both layouts at once) for ``warmup`` steps, then moves to a new layout:

- TP 2 -> 4 (TP=2 x DP=1 -> TP=4 x DP=1): ranks 0, 1 keep their processes and
  reshape their shards, ranks 2, 3 start (the restart starts all four);
- DP 2 -> 1 (TP=2 x DP=2 -> TP=2 x DP=1): replica 1 goes, replica 0 stays.

Two ways, alternated (in-memory first in odd reps, restart first in even ones):

- raytp: ``raytp.runtime.resize.resize(driver, tp, dp)`` (what ``raytp scale``
  triggers at a step boundary), then one step.
- restart (the peer, the same code the classic way): ``Driver.save_checkpoint()``
  to disk, ``release`` (actors and placement groups gone), ``load_latest`` of
  that checkpoint, a new ``Driver`` at the new layout (the job as
  ``resize.resized_config`` makes it, so both run the same micro-batches) with
  ``init_state`` from it, ``start``, then one step.

Measured: the request (before ``resize``/``save_checkpoint``) to the end of the
call that completes the next step, as the caller sees it; for raytp also the
``resized`` event's own ``seconds``, the part spent in ``resize`` itself
(``move_s``) and the request to the new layout's ``placed`` event (new workers
started and wired into process groups); for the restart the split into save +
release, load, ``start`` and the step. The restart happens inside this process,
on the running Ray: a real restart would add a new process and ``ray.init``,
which favours the peer. An untimed TP=4 job runs first: a fresh Ray's first
actors started up to 20 s slower than later ones.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench.snapshots import MODEL, close, driver, job, jsonl, med, ray_session, say, warm_up

PEER = ("stop + restart with the same code: Driver.save_checkpoint() to disk, release, new Driver at the new "
        "layout with init_state from checkpoint.load_latest, start, one step")
GOAL_RATIO = 0.3
FULL = {"model": MODEL["FULL"], "batch_size": 8, "warmup": 3, "reps": 3}
QUICK = {"model": MODEL["QUICK"], "batch_size": 4, "warmup": 2, "reps": 1}
CASES = {"tp_2_to_4": ((2, 1), (4, 1)), "dp_2_to_1": ((2, 2), (2, 1))}


def _started(p: dict, tp: int, dp: int, run_dir: Path):
    d = driver(job(p["model"], p["batch_size"], tp, dp, p["warmup"] + 10), run_dir)
    d.start()
    d.train_loop(until=p["warmup"])
    return d


def in_memory(p: dict, old: tuple, new: tuple, run_dir: Path) -> dict:
    from raytp.runtime import resize
    d = _started(p, *old, run_dir)
    try:
        w0, t0 = time.time(), time.perf_counter()
        outcome = resize.resize(d, *new)
        if not outcome.get("ok"):
            raise RuntimeError(f"resize {old} -> {new} refused: {outcome}")
        t1 = time.perf_counter()
        d.train_loop(until=d.step + 1)
        t2 = time.perf_counter()
        assert (d.layout.tp, d.layout.dp) == new and d.step == p["warmup"] + 1
    finally:
        close(d)
    evs = jsonl(run_dir / "events.jsonl")
    ev = next(e for e in evs if e["kind"] == "resized")
    placed = max(e["time"] for e in evs if e["kind"] == "placed")  # the end of the new layout's wiring
    return {"request_to_step_s": t2 - t0, "move_s": t1 - t0, "event_seconds": ev["seconds"],
            "request_to_placed_s": placed - w0, "bytes": outcome["bytes"]}


def restart(p: dict, old: tuple, new: tuple, run_dir: Path) -> dict:
    from raytp.runtime import resize
    from raytp.train import checkpoint
    d = _started(p, *old, run_dir)
    try:
        t0 = time.perf_counter()
        path = d.save_checkpoint()
        new_job = resize.resized_config(d.cfg, *new).to_dict()
    finally:
        close(d)
    t1 = time.perf_counter()
    path, manifest, full = checkpoint.load_latest(path)
    t2 = time.perf_counter()
    d2 = driver(new_job, run_dir.with_name(run_dir.name + "-restarted"),
                init_state=(manifest["step"], full, f"checkpoint {path}"))
    try:
        d2.start()
        t3 = time.perf_counter()
        d2.train_loop(until=d2.step + 1)
        t4 = time.perf_counter()
        assert (d2.layout.tp, d2.layout.dp) == new and d2.step == p["warmup"] + 1
    finally:
        close(d2)
    return {"request_to_step_s": t4 - t0, "save_and_release_s": t1 - t0, "load_s": t2 - t1,
            "start_s": t3 - t2, "step_s": t4 - t3,
            "checkpoint_bytes": sum(f.stat().st_size for f in Path(path).iterdir())}


def run(quick: bool = False) -> dict:
    p = QUICK if quick else FULL
    res = {(c, m): [] for c in CASES for m in ("raytp", "restart")}
    with ray_session(8), tempfile.TemporaryDirectory(prefix="raytp-bench-resize-") as tmp:
        warm_up(p, 4, 1, Path(tmp) / f"resize-warm-up-{os.getpid()}")
        for i in range(p["reps"]):
            for case, (old, new) in CASES.items():
                for method in (("raytp", "restart") if i % 2 == 0 else ("restart", "raytp")):
                    fn = in_memory if method == "raytp" else restart
                    r = fn(p, old, new, Path(tmp) / f"resize-{case}-{method}-{os.getpid()}-{i}")
                    res[(case, method)].append(r)
                    say(f"resize: {case} {method} rep {i + 1}: {r['request_to_step_s']:.2f}s")
    m = p["model"]
    fig: dict = {"peer": PEER, "reps": p["reps"],
                 "model": f"GPT {m['n_layer']}L x {m['n_embd']} wide, {m['n_head']} heads, block {m['block_size']}, "
                          f"batch {p['batch_size']}, resized after step {p['warmup']}"}
    met = True
    for case, (old, new) in CASES.items():
        mem, rst = res[(case, "raytp")], res[(case, "restart")]
        a, b = med([r["request_to_step_s"] for r in mem]), med([r["request_to_step_s"] for r in rst])
        fig[case] = {"layouts": f"TP={old[0]} x DP={old[1]} -> TP={new[0]} x DP={new[1]}",
                     "raytp_request_to_step_s": a, "restart_request_to_step_s": b,
                     "ratio_raytp_to_restart": round(a / b, 4),
                     "raytp_runs_s": [round(r["request_to_step_s"], 2) for r in mem],
                     "restart_runs_s": [round(r["request_to_step_s"], 2) for r in rst],
                     "raytp_resized_event_seconds": med([r["event_seconds"] for r in mem]),
                     "raytp_move_s": med([r["move_s"] for r in mem]),
                     "raytp_request_to_placed_s": med([r["request_to_placed_s"] for r in mem]),
                     "raytp_bytes_moved": mem[0]["bytes"]}
        for k in ("save_and_release_s", "load_s", "start_s", "step_s"):
            fig[case][f"restart_{k}"] = med([r[k] for r in rst])
        fig[case]["checkpoint_bytes"] = rst[0]["checkpoint_bytes"]
        met = met and a / b <= GOAL_RATIO
    fig["goal"] = f"raytp <= {GOAL_RATIO}x restart (request -> next completed step)"
    fig["goal_met"] = met
    return fig
