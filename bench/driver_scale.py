"""driver_scale: does the driver keep up at 1024 ranks?

1. The driver's own work. The real ``Driver.train_loop`` runs on the fake
   worker group of tests/fakes.py (loaded from its file: tests/ is no package)
   at 4, 64, 256 and 1024 ranks (TP=8 where it leaves two replicas, else TP=2):
   driver CPU per step
   (``time.process_time``, which includes the fake workers' own in-process
   bookkeeping: an upper bound), and the bookkeeping of a lost rank (one rank
   killed mid-run; the ``recovered`` event's seconds, from the failure to the
   next completed step: nothing in it waits for a process on the fake).
2. The streamed calls on real Ray: 16 threaded actors serve 1024 rank streams
   (each rank a proxy handle that tags its calls with the rank), each step a
   sleep. The peer is the driver's streaming as it was before this benchmark
   (``OldStepStream`` below, copied from raytp/runtime/cluster/streaming.py: records
   read rank by rank, each call submitted after the previous one ended);
   raytp's is ``StepStream`` with the next call submitted behind the current
   one (``then``): Ray hands it to the actors during the current call, and
   each rank's part waits in the actor, in raytp's own call order
   (raytp.runtime.worker.calls), until that rank's part of the current call
   has ended; only rank 0 yields a record each step, and the call reaches
   replica 0 from the driver and every other simulated node of 8 ranks
   through one of its ranks (raytp.runtime.cluster.relay): 135 submissions
   per call instead of 1024. Figures: driver CPU per step (the whole process, with Ray's
   own threads, and its main thread: raytp's reads and submissions); each
   rank's idle time between its end of call k and its start of call k+1; and
   the boundary stall, from the last rank's end of call k to the last rank's
   start of call k+1 (no collective of k+1 can finish before).
3. Lost-rank detection on the same actors: ``WorkerGroup.find_lost`` against
   the old loop (``ref in list``), nothing lost.

Goals at 1024 ranks: driver CPU <= 1% of a 1 s step, call-boundary idle <=
0.5% of a 10-step call of 1 s steps (50 ms), recovery bookkeeping < 50 ms.
"""
from __future__ import annotations

import functools
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench.driver_scale_peer import OldStepStream, old_find_lost

ROOT = Path(__file__).resolve().parent.parent
PEER = ("the driver's streaming before this change (records read rank by rank; each call submitted after "
        "the previous one ended), in the same run")
GOAL_CPU, GOAL_IDLE_S, GOAL_RECOVERY_S = 0.01, 0.05, 0.05

FULL = {"fake_ranks": (4, 64, 256, 1024), "fake_steps": 40, "ray_ranks": 1024, "actors": 16, "step_s": 1.0,
        "steps_per_call": 10, "calls": 3, "rounds": 2}
QUICK = {"fake_ranks": (4, 64), "fake_steps": 12, "ray_ranks": 32, "actors": 4, "step_s": 0.05,
         "steps_per_call": 2, "calls": 3, "rounds": 1}


def _fakes():
    """tests/fakes.py and tests/fake_driver_parts.py (tests/ is no package: it goes on the path)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import fake_driver_parts
    import fakes
    return fakes, fake_driver_parts


def _job(ranks: int, steps: int):
    from raytp.config import from_dict
    tp = 8 if ranks % 8 == 0 and ranks >= 16 else ranks // 2  # two replicas at least: a lost rank has one
    return from_dict({"model": {"n_layer": 1, "n_head": 8, "n_embd": 64, "block_size": 16, "vocab_size": 256},
                      "parallel": {"tp": tp, "dp": ranks // tp},
                      "train": {"steps": steps, "batch_size": ranks // tp, "warmup_steps": 1, "eval_interval": 0,
                                "steps_per_call": 10},
                      "checkpoint": {"every": 0}, "recovery": {"snapshot_every": 0}})


# ---------------------------------------------------------------- 1. the driver on fakes

def fake_driver_run(ranks: int, steps: int, kill_at: int | None = None) -> dict:
    from raytp.runtime.driver.driver import Driver
    fakes, parts = _fakes()
    cluster = fakes.FakeCluster(slots=ranks)
    if kill_at is not None:
        cluster.kill_at(kill_at, ranks - 1)

    class FakeDriver(Driver):
        group_cls = cluster.group_class()
        control_cls = parts.LocalControl
        copy_cls = parts.NoCopy

    with tempfile.TemporaryDirectory(prefix="raytp-bench-drv-") as tmp:
        d = FakeDriver(_job(ranks, steps), Path(tmp) / "run", "bench", out=io.StringIO(), ray_metrics=False)
        try:
            d.start()
            d.train_loop(until=1)  # the first call (one step): start-up, not the steady state
            cpu0, t0 = time.process_time(), time.perf_counter()
            d.train_loop()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
            rec = [e for e in _events(Path(tmp) / "run") if e["kind"] == "recovered"]
        finally:
            d.release()
            d.log.close()
    out = {"cpu_per_step_s": round(cpu / (steps - 1), 6), "wall_per_step_s": round(wall / (steps - 1), 6)}
    if rec:
        out["recovery_s"] = round(rec[0]["seconds"], 5)
    return out


def _events(run_dir: Path) -> list[dict]:
    import json
    return [json.loads(line) for line in open(run_dir / "events.jsonl")]


# ---------------------------------------------------------------- 2. streams on real Ray

class SimWorker:
    """Serves many ranks' step streams, each rank's calls in the order raytp's Worker keeps
    (raytp.runtime.worker.calls: a call queued behind another starts once that one's steps ended):
    each step a sleep; keeps when each (rank, call) began and ended."""

    def __init__(self, step_s: float):
        self.step_s, self.times, self.calls = step_s, {}, {}

    def run_steps(self, rank: int, start: int, count: int, snapshot_every: int, seq: int, after: int | None = None,
                  report: bool = True, relay: list | None = None):
        from raytp.runtime.cluster import relay as relay_calls
        peers = relay_calls.forward(relay, (start, count, snapshot_every, seq, after)) if relay else []
        yield from self._own(rank, start, count, seq, after, report)
        relay_calls.collect(peers)

    def _own(self, rank, start, count, seq, after, report):
        from raytp.runtime.worker.calls import Calls
        calls = self.calls.setdefault(rank, Calls())
        calls.begin(seq, start, after)
        t0 = time.time()
        for step in range(start, start + count):
            time.sleep(self.step_s)
            if step == start + count - 1:  # as the Worker: the call ends with its steps, before the last yield
                self.times[(rank, start)] = (t0, time.time())
                calls.end(seq, start + count)
            if report:
                yield {"step": step, "rank": rank}

    def ping(self, rank: int) -> int:
        return rank

    def taken(self) -> dict:
        return self.times


class _Method:
    def __init__(self, method, rank: int, opts=None):
        self.method, self.rank, self.opts = method, rank, opts

    def options(self, **opts):
        return _Method(self.method, self.rank, opts)

    def remote(self, *args):
        m = self.method.options(**self.opts) if self.opts else self.method
        return m.remote(self.rank, *args)


class RankHandle:
    """One rank's view of a SimWorker actor: its calls carry the rank."""

    def __init__(self, actor, rank: int):
        self.run_steps, self.ping = _Method(actor.run_steps, rank), _Method(actor.ping, rank)


def ray_round(impl: str, actors, p: dict) -> dict:
    import ray
    from raytp.parallel.layout import Layout
    from raytp.runtime.cluster.relay import relay_plan
    from raytp.runtime.cluster.streaming import StepStream, direct_ranks
    n, spc, calls = p["ray_ranks"], p["steps_per_call"], p["calls"]
    workers = [RankHandle(actors[r % len(actors)], r) for r in range(n)]
    lay = Layout(8 if n % 8 == 0 else n, dp=n // (8 if n % 8 == 0 else n))
    base = int(time.time() * 1000) % 1_000_000 * 100  # call starts unique to this round
    relay = {}
    if impl == "after":  # as WorkerGroup.relay makes it once per group: nodes of 8 ranks (one TP group each)
        plan = relay_plan(direct_ranks(lay), [f"node{r // 8}" for r in range(n)])
        relay = {lead: (peers, ray.put([workers[p] for p in peers])) for lead, peers in plan.items() if peers}
    make = OldStepStream if impl == "before" else functools.partial(StepStream, relay=relay)
    submit, read, at_boundary = [], [], []  # main-thread CPU of each submission, of each step's read; wall

    def submitted(fn):
        c0 = time.thread_time()
        out = fn()
        submit.append(time.thread_time() - c0)
        return out

    cpu0, t0 = time.process_time(), time.perf_counter()
    stream = submitted(lambda: make(workers, lay, base, spc, 0, 120.0))
    for k in range(calls):
        behind, steps, c0 = None, iter(stream), time.thread_time()
        for i in range(spc):
            next(steps)
            read.append(time.thread_time() - c0)
            if i == 0 and impl == "after" and k + 1 < calls:
                behind = submitted(lambda: stream.then(spc, 0))  # as the Driver does: once the call runs
            c0 = time.thread_time()
        if k + 1 < calls:
            w0 = time.perf_counter()  # the driver between the last record of call k and call k+1 submitted
            stream = behind or submitted(lambda: make(workers, lay, base + (k + 1) * spc, spc, 0, 120.0))
            at_boundary.append(time.perf_counter() - w0)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    times = {}
    for t in ray.get([a.taken.remote() for a in actors]):
        times.update(t)
    stalls, idle = [], []
    for k in range(calls - 1):
        ends = [times[(r, base + k * spc)][1] for r in range(n)]
        starts = [times[(r, base + (k + 1) * spc)][0] for r in range(n)]
        stalls.append(max(starts) - max(ends))
        idle += [b - e for b, e in zip(starts, ends)]
    return {"cpu_per_step_s": cpu / (calls * spc), "read_cpu_per_step_s": statistics.median(read),
            "submit_cpu_per_call_s": statistics.median(submit), "driver_at_boundary_s": statistics.median(at_boundary),
            "main_cpu_per_step_s": (sum(read) + sum(submit)) / (calls * spc), "wall_s": wall,
            "stall_s": statistics.median(stalls), "idle_s": statistics.median(idle),
            "idle_p99_s": sorted(idle)[int(0.99 * (len(idle) - 1))]}


def find_lost_round(impl: str, actors, n: int) -> float:
    from raytp.runtime.cluster.group import WorkerGroup
    workers = [RankHandle(actors[r % len(actors)], r) for r in range(n)]
    t0 = time.perf_counter()
    if impl == "before":
        lost = old_find_lost(workers, 30.0)
    else:
        group = SimpleNamespace(workers=workers, cfg=SimpleNamespace(recovery=SimpleNamespace(ping_timeout_s=30.0)))
        lost = WorkerGroup.find_lost(group)
    assert not lost, lost
    return time.perf_counter() - t0


def ray_part(p: dict) -> dict:
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="raytp-bench", log_to_driver=False)
    try:
        per_actor = -(-p["ray_ranks"] // p["actors"])
        cls = ray.remote(num_cpus=0, max_concurrency=2 * per_actor + 4)(SimWorker)
        actors = [cls.remote(p["step_s"]) for _ in range(p["actors"])]
        ray.get([a.ping.remote(0) for a in actors])
        ray_round("after", actors, {**p, "calls": 2})  # warm-up: the actors' threads
        got = {"before": [], "after": []}
        lost = {"before": [], "after": []}
        for i in range(p["rounds"]):
            for impl in (("before", "after") if i % 2 == 0 else ("after", "before")):
                got[impl].append(ray_round(impl, actors, p))
                lost[impl].append(find_lost_round(impl, actors, p["ray_ranks"]))
                print(f"  driver_scale: ray round {i + 1}/{p['rounds']} ({impl}) done", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    out = {}
    for impl in ("before", "after"):
        out[impl] = {"driver_cpu_per_step_s": round(statistics.median(r["cpu_per_step_s"] for r in got[impl]), 5),
                     "driver_main_thread_cpu_per_step_s": round(statistics.median(
                         r["main_cpu_per_step_s"] for r in got[impl]), 5),
                     "read_cpu_per_step_s": round(statistics.median(r["read_cpu_per_step_s"] for r in got[impl]), 5),
                     "submit_cpu_per_call_s": round(statistics.median(
                         r["submit_cpu_per_call_s"] for r in got[impl]), 4),
                     "driver_at_boundary_s": round(statistics.median(r["driver_at_boundary_s"] for r in got[impl]), 4),
                     "rank_idle_median_s": round(statistics.median(r["idle_s"] for r in got[impl]), 4),
                     "rank_idle_p99_s": round(statistics.median(r["idle_p99_s"] for r in got[impl]), 4),
                     "call_boundary_stall_s": round(statistics.median(r["stall_s"] for r in got[impl]), 4),
                     "wall_s": round(statistics.median(r["wall_s"] for r in got[impl]), 3),
                     "find_lost_s": round(statistics.median(lost[impl]), 4)}
    return out


# ---------------------------------------------------------------- the benchmark

def run(quick: bool = False) -> dict:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray's import: loopback only
    p = QUICK if quick else FULL
    fig: dict = {"peer": PEER}
    fake = {}
    for n in p["fake_ranks"]:
        steady = fake_driver_run(n, p["fake_steps"])
        healed = fake_driver_run(n, p["fake_steps"], kill_at=p["fake_steps"] // 2)
        fake[f"ranks{n}"] = {**steady, "recovery_s": healed.get("recovery_s")}
        print(f"  driver_scale: fake driver at {n} ranks done", file=sys.stderr, flush=True)
    fig["fake_driver"] = fake
    n = p["ray_ranks"]
    fig["ray_streams"] = {**ray_part(p), "ranks": n, "actors": p["actors"], "step_s": p["step_s"],
                          "steps_per_call": p["steps_per_call"], "calls": p["calls"], "rounds": p["rounds"]}
    top = fake[f"ranks{max(p['fake_ranks'])}"]
    after = fig["ray_streams"]["after"]
    # the driver's own code: the loop (fakes) plus its main thread's reads and submissions on Ray
    cpu_1s = after["driver_main_thread_cpu_per_step_s"] + top["cpu_per_step_s"]
    fig["goals"] = {
        "driver_cpu_share_of_1s_step": round(cpu_1s, 4), "driver_cpu_goal": f"<= {GOAL_CPU}",
        "driver_cpu_met": cpu_1s <= GOAL_CPU,
        "driver_process_cpu_share_of_1s_step": after["driver_cpu_per_step_s"],  # with Ray's own threads
        "call_boundary_stall_s": after["call_boundary_stall_s"], "idle_goal_s": f"<= {GOAL_IDLE_S}",
        "idle_met": after["call_boundary_stall_s"] <= GOAL_IDLE_S,
        "recovery_bookkeeping_s": top["recovery_s"], "recovery_goal_s": f"< {GOAL_RECOVERY_S}",
        "recovery_met": top["recovery_s"] is not None and top["recovery_s"] < GOAL_RECOVERY_S,
        "at_ranks": {"fake_driver": max(p["fake_ranks"]), "ray_streams": n}}
    fig["method"] = ("fake_driver: the real Driver.train_loop on tests/fakes.py's group (TP=8 where it divides, "
                     "steps_per_call 10, no evaluation/checkpoints/snapshots), CPU per step after the first call; "
                     "recovery_s: one rank killed mid-run, the recovered event's seconds; ray_streams: "
                     f"{p['actors']} threaded actors serving {n} rank streams on an embedded Ray (2 CPUs), each "
                     "step a sleep of step_s; driver CPU: process CPU (with Ray's own threads) and its main thread "
                     "(raytp's reads and submissions); rank idle = a rank's start of call k+1 - its end of call k "
                     "(median, p99 over ranks and boundaries); stall = last rank's start of call k+1 - last "
                     "rank's end of call k (no collective of k+1 finishes before), median over boundaries; medians "
                     "over rounds (before/after alternate within a round)")
    return fig
