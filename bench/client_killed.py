"""recovery's "client killed": the gap in training that SIGKILL of `raytp train` leaves in a run that joined a
cluster (its coordinator, raytp.runtime.driver.coordinator, trains on).

`raytp train JOB --address <this Ray>` runs as a process of its own, TP=2 x DP=2 (the model and batches of
bench/recovery); once `kill_step` steps are in metrics.jsonl, the process is SIGKILLed. The run goes on with
no client; `raytp attach` follows it to its end. Measured from metrics.jsonl's `time`s: the longest interval
between two steps from the kill on against the median interval before it (a normal step; the goal is at
most 2x), and every step there exactly once.
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

from bench.snapshots import job, jsonl

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
    attach = subprocess.run(_cli("attach", run_dir.name, "--address", address), cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    if attach.returncode != 0:
        raise RuntimeError(f"raytp attach failed: {attach.stderr[-2000:]}")
    recs = jsonl(run_dir / "metrics.jsonl")
    times = [r["time"] for r in recs]
    before = [b - a for a, b in zip(times, times[1:]) if b <= killed][1:]  # the first holds the call's start
    after = [b - a for a, b in zip(times, times[1:]) if b > killed]
    normal, gap = statistics.median(before), max(after)
    return {"normal_step_s": normal, "gap_after_kill_s": gap, "ratio": gap / normal,
            "longest_gap_before_kill_s": max(before),
            "steps_after_kill": len(after), "every_step_once": [r["step"] for r in recs] == list(range(steps)),
            "attach_exit": attach.returncode}


def figures(rs: list[dict]) -> dict:
    ratio = max(r["ratio"] for r in rs)
    return {"what": "SIGKILL of `raytp train` (the client) of a TP=2 x DP=2 run joined to the cluster; "
                    "`raytp attach` follows it to the end",
            "normal_step_s": round(statistics.median(r["normal_step_s"] for r in rs), 4),
            "longest_gap_after_kill_s": round(max(r["gap_after_kill_s"] for r in rs), 4),
            "longest_gap_before_kill_s": round(max(r["longest_gap_before_kill_s"] for r in rs), 4),
            "gap_to_normal_step": round(ratio, 3), "runs_ratio": [round(r["ratio"], 3) for r in rs],
            "every_step_once": all(r["every_step_once"] for r in rs),
            "goal": f"no gap over {GOAL_GAP_RATIO:g}x a normal step", "goal_met": ratio <= GOAL_GAP_RATIO}
