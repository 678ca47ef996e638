"""recovery's "client killed": the gap in training that SIGKILL of `raytp train` leaves in a run that joined a
cluster (its coordinator, raytp.runtime.coordinator, trains on).

Also a benchmark of its own (`python -m bench client_killed`): only this part, its reps in one Ray.

`raytp train JOB --address <this Ray>` runs as a process of its own, TP=2 x DP=2 (the model and batches of
bench/recovery); once `kill_step` steps are in metrics.jsonl, the process is SIGKILLed. The run goes on with
no client and is left to end by itself (`raytp attach` is tested in tests/test_cluster_jobs.py; here its
process start would take the 2 cores from the workers). Measured from metrics.jsonl's `time`s: the longest
interval between steps in the second after the kill (the gap it causes) against the median interval before
it (a normal step; the goal is at most 2x), the longest intervals before and after the kill (the machine's
own noise), and every step exactly once.
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.snapshots import MODEL, job, jsonl, ray_session, say

GOAL_GAP_RATIO = 2.0
ROOT = Path(__file__).resolve().parents[1]


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "raytp.cli", *args]


def client_killed_once(p: dict, run_dir: Path, address: str) -> dict:
    k, steps = p["kill_step"], p["kill_step"] + p["client_after"]
    spec = job(p["model"], p["batch_size"], 2, 2, steps, train={"steps_per_call": 2})
    job_file = run_dir.with_suffix(".yaml")
    job_file.write_text(yaml.safe_dump(spec))
    env = {key: v for key, v in os.environ.items() if key != "RAY_ADDRESS"}
    client = subprocess.Popen(_cli("train", str(job_file), "--address", address, "--name", run_dir.name,
                                   "--run-dir", str(run_dir)), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while len(jsonl(run_dir / "metrics.jsonl")) < k:
        if client.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the client ended before step {k}: {client.stderr.read()[-2000:]}")
        time.sleep(0.01)
    killed = time.time()
    client.send_signal(signal.SIGKILL)
    client.wait()
    while not any(e["kind"] in ("finished", "failed", "stopped") for e in jsonl(run_dir / "events.jsonl")):
        if time.monotonic() > deadline:
            raise RuntimeError("the run did not end after its client was killed")
        time.sleep(0.1)
    recs = jsonl(run_dir / "metrics.jsonl")
    times = [r["time"] for r in recs]
    pairs = list(zip(times, times[1:]))
    before = [b - a for a, b in pairs if b <= killed][1:]  # the first holds the first call's start
    after = [b - a for a, b in pairs if b > killed]
    at_kill = max(b - a for a, b in pairs if killed < b <= killed + 1.0 or a <= killed < b)
    normal = statistics.median(before)
    return {"normal_step_s": normal, "gap_at_kill_s": at_kill, "ratio": at_kill / normal,
            "longest_gap_before_kill_s": max(before), "longest_gap_after_kill_s": max(after),
            "steps_after_kill": len(after), "every_step_once": [r["step"] for r in recs] == list(range(steps)),
            "finished": jsonl(run_dir / "events.jsonl")[-1]["kind"] == "finished"}


def figures(rs: list[dict]) -> dict:
    ratio = max(r["ratio"] for r in rs)
    return {"what": "SIGKILL of `raytp train` (the client) of a TP=2 x DP=2 run joined to the cluster; "
                    "it trains on to its end with no client",
            "normal_step_s": round(statistics.median(r["normal_step_s"] for r in rs), 4),
            "gap_at_kill_s": round(max(r["gap_at_kill_s"] for r in rs), 4),
            "longest_gap_before_kill_s": round(max(r["longest_gap_before_kill_s"] for r in rs), 4),
            "longest_gap_after_kill_s": round(max(r["longest_gap_after_kill_s"] for r in rs), 4),
            "gap_to_normal_step": round(ratio, 3), "runs_ratio": [round(r["ratio"], 3) for r in rs],
            "every_step_once": all(r["every_step_once"] for r in rs), "finished": all(r["finished"] for r in rs),
            "goal": f"no gap over {GOAL_GAP_RATIO:g}x a normal step", "goal_met": ratio <= GOAL_GAP_RATIO}


PEER = ("the run's own steps before the kill (a normal step); before the coordinator, the client's death "
        "released every worker 2.5 s later and --resume went back to the last checkpoint")


def run(quick: bool = False) -> dict:
    import tempfile
    p = {"model": MODEL["QUICK" if quick else "FULL"], "batch_size": 4 if quick else 8,
         "kill_step": 10 if quick else 20, "client_after": 20 if quick else 40}
    rs = []
    with ray_session(8) as ray, tempfile.TemporaryDirectory(prefix="raytp-bench-client-") as tmp:
        for i in range(1 if quick else 3):
            rs.append(client_killed_once(p, Path(tmp) / f"client-{os.getpid()}-{i}",
                                         ray.get_runtime_context().gcs_address))
            say(f"client_killed rep {i + 1}: gap at the kill {rs[-1]['gap_at_kill_s']:.3f}s, "
                f"{rs[-1]['ratio']:.2f}x a normal step")
    return {"peer": PEER, **figures(rs)}
