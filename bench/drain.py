"""drain: a node that Ray drains, against the same node lost without warning (how a drain was handled before).

A simulated cluster (ray.cluster_utils on loopback: a head of 1 CPU for the driver, three nodes of 2 CPUs and
2 fake GPUs), raytp's Driver in a thread at TP=2 x DP=1 (one node's workers, no DP twin; in-memory snapshots
at the default cadence and their off-node copy), the GPT of jobs/default.yaml's shape. After `at` steps:

- drain: ``ray drain-node`` of the workers' node (the GCS call it makes: preemption, a 30 s deadline); the
  node is removed at the deadline if still there, as the autoscaler would. Measured: drain -> the ``draining``
  event (seen), drain -> the ``moved`` event (logged with the first step after the move: the ranks are off
  and training goes on), the move's pause (``stall_s``), steps lost, ``failure`` events.
- crash (the peer: raytp before it read drains, and any tool that learns of a node's end from its death): the
  same node removed at once. Measured: removal -> the ``recovered`` event (the first step after healing),
  steps lost (run again from the newest snapshot's copy).

Each rep is a fresh job on fresh nodes, drain then crash; medians over reps.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

from bench.snapshots import MODEL, driver, job, jsonl, med, say

PEER = ("the same node lost without warning (removed at once), healed by recovery: what a drain was before "
        "raytp read Ray's draining nodes")
FULL = {"model": MODEL["FULL"], "batch_size": 8, "at": 20, "after": 15, "reps": 2, "deadline_s": 30}
QUICK = {"model": MODEL["QUICK"], "batch_size": 4, "at": 5, "after": 5, "reps": 1, "deadline_s": 30}
STEPS = 100_000  # stopped once measured


def _until(cond, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout:g} s")
        time.sleep(0.01)


def _steps(run_dir: Path) -> int:
    return len(jsonl(run_dir / "metrics.jsonl"))


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


def once(cluster, p: dict, run_dir: Path, drain: bool) -> dict:
    import ray
    from ray.core.generated import autoscaler_pb2
    d = driver(job(p["model"], p["batch_size"], 2, 1, STEPS, runtime={"gpus_per_worker": 1.0}), run_dir)
    errors: list = []
    t = threading.Thread(target=lambda: errors.append(_run(d)), daemon=True)
    t.start()
    node = None
    try:
        _until(lambda: _steps(run_dir) >= p["at"] or not t.is_alive(), "the job did not reach its step")
        node_id = d.group.nodes()[0]
        node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
        t0 = time.time()
        if drain:
            gcs = ray._raylet.GcsClient(address=cluster.address)
            ok, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                     "bench: preemption", int((t0 + p["deadline_s"]) * 1000))
            if not ok:
                raise RuntimeError(f"drain refused: {why}")
            _until(lambda: _events(run_dir, "moved") or time.time() > t0 + p["deadline_s"], "no move")
        else:
            cluster.remove_node(node)
            _until(lambda: _events(run_dir, "recovered") or not t.is_alive(), "no recovery")
        if t.is_alive():
            n = _steps(run_dir)
            _until(lambda: _steps(run_dir) >= n + p["after"], "no steps after")
            d.request_stop(via="control")
        t.join(timeout=300)
    finally:
        if node is not None and node in cluster.worker_nodes:  # the autoscaler ends a drained node, at its deadline at the latest
            cluster.remove_node(node)
    failures = _events(run_dir, "failure")
    if not drain and errors != [None]:  # nothing held the lost state (no copy yet, no checkpoint): the run ended
        return {"loss_to_step_s": None, "lost_steps": None, "source": f"failed: {errors[0]}"[:160],
                "failures": len(failures)}
    if errors != [None]:
        raise RuntimeError(f"the job failed: {errors}")
    if drain:
        (seen,), moved = _events(run_dir, "draining"), _events(run_dir, "moved")
        if not moved:
            raise RuntimeError("the ranks did not leave the drained node before its deadline")
        return {"drain_to_seen_s": seen["time"] - t0, "drain_to_off_s": moved[0]["time"] - t0,
                "paused_s": moved[0]["stall_s"], "lost_steps": moved[0]["lost_steps"], "failures": len(failures),
                "before_deadline": moved[0]["time"] < t0 + p["deadline_s"]}
    (rec,) = _events(run_dir, "recovered")
    return {"loss_to_step_s": rec["time"] - t0, "lost_steps": rec["lost_steps"], "source": rec["source"],
            "failures": len(failures)}


def _run(d):
    try:
        d.run_to_end()
    except Exception as e:  # noqa: BLE001 - handed to the caller
        return e


def run(quick: bool = False) -> dict:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray.cluster_utils import Cluster
    p = QUICK if quick else FULL
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    ray.init(address=cluster.address, namespace="raytp", log_to_driver=False)
    drains, crashes = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="raytp-bench-drain-") as tmp:
            for i in range(p["reps"]):
                for drain, out in ((True, drains), (False, crashes)):
                    for node in list(cluster.worker_nodes):
                        cluster.remove_node(node)
                    for _ in range(3):
                        cluster.add_node(num_cpus=2, num_gpus=2)
                    cluster.wait_for_nodes()
                    r = once(cluster, p, Path(tmp) / f"drain-{int(drain)}-{i}", drain)
                    out.append(r)
                    say(f"drain: rep {i + 1} {'drain' if drain else 'crash'}: {r}")
    finally:
        ray.shutdown()
        cluster.shutdown()
    m = p["model"]
    return {"peer": PEER, "reps": p["reps"],
            "model": f"GPT {m['n_layer']}L x {m['n_embd']} wide, batch {p['batch_size']}, TP=2 x DP=1, "
                     f"drained after step {p['at']} with a {p['deadline_s']} s deadline",
            "drain_to_seen_s": med([r["drain_to_seen_s"] for r in drains]),
            "drain_to_ranks_off_s": med([r["drain_to_off_s"] for r in drains]),
            "drain_paused_s": med([r["paused_s"] for r in drains]),
            "drain_lost_steps": [r["lost_steps"] for r in drains],
            "drain_failures": [r["failures"] for r in drains],
            "drain_before_deadline": all(r["before_deadline"] for r in drains),
            "crash_to_step_s": med([r["loss_to_step_s"] for r in crashes if r["loss_to_step_s"] is not None] or [0.0]),
            "crash_lost_steps": [r["lost_steps"] for r in crashes],
            "crash_source": sorted({r["source"] for r in crashes}),
            "goal": "ranks off a drained node before its deadline, no failure, 0 steps lost",
            "goal_met": all(r["before_deadline"] and not r["failures"] and not r["lost_steps"] for r in drains)}
