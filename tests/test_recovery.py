"""Fault recovery: kill workers from outside (as reality does) and the job finishes with the very
weights of an uninterrupted run."""
import json
import os
import random
import signal
import threading
import time

import pytest
import ray
import torch

from conftest import ray_actors
from raytp.runtime.driver import Driver
from raytp.runtime.recovery import RecoveryFailed
from raytp.runtime.worker import Worker
from raytp.train import checkpoint
from test_runtime import job

STEPS = 16


def recovery_job(tp, dp, **kw):
    return job(tp, dp, steps=STEPS, checkpoint={"every": STEPS, "keep": 2},
               recovery=kw.pop("recovery", {}), step_timeout_s=kw.pop("step_timeout_s", 30.0), **kw)


def events(run_dir, kind=None):
    evs = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    return [e for e in evs if kind is None or e["kind"] == kind]


def final_state(run_dir):
    return checkpoint.load(run_dir / "checkpoints" / f"step-{STEPS:08d}")[1]


def assert_bitwise_equal(a, b):
    for n in a["model"]:
        assert torch.equal(a["model"][n], b["model"][n]), n
        for k in a["optim"][n]:
            assert torch.equal(a["optim"][n][k], b["optim"][n][k]), (n, k)


def run(cfg, run_dir, name, faults=(), worker_cls=Worker):
    """Run a job in a thread; `faults` are (after_step, action(run_name)) applied from outside."""
    d = Driver(cfg, run_dir, name, out=open(run_dir.parent / f"{name}.out", "w"))
    d.worker_cls = worker_cls
    errors = []
    t = threading.Thread(target=lambda: errors.append(_run(d)), daemon=True)
    t.start()
    for after, action in faults:
        while t.is_alive() and _steps_logged(run_dir) < after:
            time.sleep(0.005)
        action(name)
    t.join(timeout=240)
    assert not t.is_alive(), "the job did not finish"
    assert errors == [None], errors
    return d


def _run(d):
    try:
        d.run_to_end()
    except Exception as e:  # noqa: BLE001 - handed to the test
        return e


def _steps_logged(run_dir):
    try:
        return sum(1 for _ in open(run_dir / "metrics.jsonl"))
    except FileNotFoundError:
        return 0


def signal_rank(rank, sig):
    def action(run_name):
        name = f"raytp.{run_name}.rank{rank}"
        pid = ray_actors(name)[name]["pid"]  # the pid as Ray's actor table has it
        os.kill(pid, sig)
    return action


@pytest.fixture(scope="module")
def reference(ray_local, tmp_path_factory):
    """Uninterrupted runs, by layout."""
    out = {}
    for tp, dp in [(2, 2), (4, 1)]:
        run_dir = tmp_path_factory.mktemp(f"ref-tp{tp}-dp{dp}")
        run(recovery_job(tp, dp), run_dir, f"ref{tp}{dp}")
        out[(tp, dp)] = final_state(run_dir)
    return out


@pytest.mark.parametrize("tp, dp", [(2, 2), (4, 1)])
def test_sigkill_of_a_random_worker_loses_nothing(reference, tmp_path, tp, dp):
    rng = random.Random(f"{tp}{dp}{os.environ.get('RAYTP_TEST_SEED', '')}")
    rank, step = rng.randrange(tp * dp), rng.randrange(2, STEPS - 4)
    run_dir = tmp_path / "run"
    run(recovery_job(tp, dp), run_dir, "kill", faults=[(step, signal_rank(rank, signal.SIGKILL))])
    assert_bitwise_equal(final_state(run_dir), reference[(tp, dp)])
    (fail,), (rec,) = events(run_dir, "failure"), events(run_dir, "recovered")
    assert fail["rank"] == rank and fail["cause"] == "died", f"killed rank {rank} after step {step}"
    if dp > 1:
        assert rec["source"] == "replica" and rec["lost_steps"] == 0
    else:
        assert rec["source"] == "snapshot" and rec["lost_steps"] <= 1  # snapshot_every = 1
    assert rec["seconds"] < 5
    metrics = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
    assert metrics == list(range(STEPS)), "one metrics line per step, none twice"
