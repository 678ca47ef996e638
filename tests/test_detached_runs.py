"""A run that joins a cluster outlives the process that started it (raytp.runtime.coordinator): killed
clients, `raytp attach`, a client's SIGTERM, orphaned runs, on a real `ray start` head (tests/ray_head.py)."""
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_head import NEVER_S, ROOT, SMALL, _env, end_runs, leftovers, raytp, wait_for

from raytp.runtime.coordinator.actor import FOLLOWING_S

# DP=2 (two workers; a TP group of the default job's two would double the process starts and prove nothing more
# of a run outliving its client: the checkpoints compared are whole either way).
OUTLIVES = [*SMALL, "--set", "parallel.tp=1", "--set", "parallel.dp=2", "--set", "train.steps_per_call=2"]
ONE_WORKER = ["--set", "parallel.tp=1", "--set", "parallel.dp=1"]  # what a test of the client alone needs
CKPT = 20  # the step both runs checkpoint (the client of the second is killed at half of it)
LONG = ["--set", "train.steps=100000", "--set", f"checkpoint.every={CKPT}", "--set", "checkpoint.keep=50"]  # CKPT kept however late the SIGTERM


@pytest.fixture(autouse=True)
def _no_run_left(head):
    """A test that failed midway leaves no run training into the next one."""
    yield
    end_runs(head)


def client(head, run: str, run_dir, *sets, env=None):
    """`raytp train` of a run joined to the head, as a process of its own."""
    return subprocess.Popen([sys.executable, "-m", "raytp.cli", "train", "jobs/default.yaml", "--address", head.gcs,
                             "--name", run, "--run-dir", str(run_dir), *OUTLIVES, *sets], cwd=ROOT,
                            env=_env(**(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_run_outlives_its_killed_client_and_attach_follows_it(head, tmp_path):
    """TP=1 x DP=2: an unbroken run is stopped by its client's SIGTERM (what `ray job stop` sends) once its
    step-20 checkpoint is written; the same job's client is SIGKILLed at step 10, the run trains on, `raytp
    attach` follows it and its SIGTERM stops it past step 20. Every step is recorded once, and the two step-20
    checkpoints are equal bit for bit. A running run's name is refused; the client's tracker variables reach
    the workers, no other."""
    from helpers import assert_bitwise_equal, events, final_state, steps_logged

    def checkpointed(run_dir):
        return lambda: any(e["step"] == CKPT for e in events(run_dir, "checkpoint")) if steps_logged(run_dir) else None

    whole = client(head, "whole", tmp_path / "whole", *LONG, env={"WANDB_PROBE": "from the client",
                                                                  "UNRELATED_PROBE": "stays"})
    try:
        wait_for("the run to train", lambda: steps_logged(tmp_path / "whole") >= 2 or whole.poll() is not None,
                 every=0.2)
        for worker in events(tmp_path / "whole", "placed")[0]["ranks"]:
            environ = Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
            assert b"WANDB_PROBE=from the client" in environ
            assert not any(e.startswith(b"UNRELATED_PROBE") for e in environ)
        again = raytp("train", "jobs/default.yaml", "--address", head.gcs, "--name", "whole", "--run-dir",
                      str(tmp_path / "other"), *OUTLIVES)
        assert again.returncode == 2 and "raytp attach whole" in again.stderr, again.stderr[-2000:]
        assert not (tmp_path / "other").exists()  # refused before anything was written
        wait_for(f"the step-{CKPT} checkpoint", checkpointed(tmp_path / "whole"), every=0.5)
        whole.send_signal(signal.SIGTERM)
        out, _ = whole.communicate(timeout=NEVER_S)
    finally:
        whole.kill()
    assert whole.returncode == 0 and re.search(r"\[raytp\] stopped after \d+ steps", out), out[-3000:]
    (stopped,) = events(tmp_path / "whole", "stopped")
    assert stopped["via"] == "SIGTERM" and stopped["checkpoint"]

    cut = client(head, "cut", tmp_path / "cut", *LONG)
    try:
        wait_for(f"step {CKPT // 2} of the run",
                 lambda: steps_logged(tmp_path / "cut") >= CKPT // 2 or cut.poll() is not None,
                 every=0.2)
        assert cut.poll() is None, cut.stdout.read()[-3000:]
    finally:
        cut.kill()  # SIGKILL: the client is gone, as a closed laptop's
        cut.wait()
    at = steps_logged(tmp_path / "cut")
    time.sleep(FOLLOWING_S)  # a client seen this recently still follows (each `raytp status` is ~2 s of CPU)
    status = wait_for("the run to say it has no client", lambda: (s := raytp("status", "cut", "--address", head.gcs))
                      and "client: none since" in s.stdout and s, every=2)
    assert "cut: running" in status.stdout, status.stdout
    wait_for("the run to train on without its client", lambda: steps_logged(tmp_path / "cut") > at + 2, every=0.2)

    attached = subprocess.Popen([sys.executable, "-m", "raytp.cli", "attach", "cut", "--address", head.gcs], cwd=ROOT,
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in attached.stdout:  # following once it says so (a SIGTERM before its start would end it)
            seen.append(line)
            if "[raytp] attached to run cut" in line:
                break
        wait_for(f"the step-{CKPT} checkpoint", checkpointed(tmp_path / "cut"), every=0.5)
        attached.send_signal(signal.SIGTERM)
        out, _ = attached.communicate(timeout=NEVER_S)
        out = "".join(seen) + out
    finally:
        attached.kill()
    assert attached.returncode == 0, out[-3000:]
    assert "[raytp] attached to run cut at step" in out and re.search(r"\[raytp\] stopped after \d+ steps", out)
    (stopped,) = events(tmp_path / "cut", "stopped")
    steps_seen = [json.loads(line)["step"] for line in open(tmp_path / "cut" / "metrics.jsonl")]
    assert steps_seen == list(range(stopped["step"]))  # every step exactly once
    assert events(tmp_path / "cut", "failure") == []
    assert_bitwise_equal(final_state(tmp_path / "whole", CKPT), final_state(tmp_path / "cut", CKPT))
    for run in ("whole", "cut"):
        assert wait_for("the run's actors to go", lambda: leftovers(head, run) == [] or None)


@pytest.mark.slow
def test_a_run_nobody_follows_is_stopped_with_a_checkpoint_after_its_orphan_timeout(head, tmp_path):
    from helpers import events, steps_logged
    run_dir = tmp_path / "orphan"
    p = client(head, "orphan", run_dir, *ONE_WORKER, "--set", "train.steps=100000", "--set", "checkpoint.every=0",
               "--set", "runtime.orphan_timeout_s=2")
    try:
        wait_for("the run to train", lambda: steps_logged(run_dir) >= 2 or p.poll() is not None, every=0.2)
        assert p.poll() is None, p.stdout.read()[-3000:]
    finally:
        p.kill()
        p.wait()
    stopped = wait_for("the orphaned run to stop", lambda: events(run_dir, "stopped"), every=0.5)
    assert stopped[0]["via"] == "orphaned" and stopped[0]["checkpoint"], stopped
    assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    assert "no client has followed the run for 2s" in (run_dir / "driver.log").read_text()
    assert wait_for("the run's actors and placement groups to go", lambda: leftovers(head, "orphan") == [] or None)
