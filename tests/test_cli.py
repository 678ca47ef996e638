"""`raytp train` as a user runs it: a fresh process, the default job, an embedded Ray."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"step", "loss", "lr", "tokens", "step_time_s", "tokens_per_s", "tp", "dp"}


def raytp(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "raytp.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_default_job_trains_and_writes_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    p = raytp("train", "jobs/default.yaml", "--set", "train.steps=40", "--set", "train.eval_interval=20",
              "--run-dir", str(run_dir))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"run run  dir {run_dir}" in p.stderr
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(40))
    assert all(REQUIRED <= m.keys() for m in metrics)
    assert metrics[0]["tp"] == 2 and metrics[0]["dp"] == 1
    assert sum(m["loss"] for m in metrics[-5:]) / 5 < metrics[0]["loss"] - 1.0, "loss did not fall"
    events = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished" and all("time" in e for e in events)
    assert (run_dir / "config.yaml").exists()
    assert "step 40/40" in p.stderr


@pytest.mark.parametrize("args, key", [
    (["--set", "parallel.tp=3"], "parallel.tp"),
    (["--set", "train.stepz=3"], "train.stepz"),
    (["--set", "train.lr=abc"], "train.lr"),
    (["--set", "model.n_layer=0"], "model.n_layer"),
    (["--set", "train.batch_size=7", "--set", "parallel.dp=2"], "train.batch_size"),
    (["--set", "data.source=/nonexistent/corpus"], "data.source"),
])
def test_bad_job_exits_before_ray_starts(args, key, tmp_path):
    t0 = time.monotonic()
    p = raytp("train", "jobs/default.yaml", *args, "--run-dir", str(tmp_path / "r"))
    assert p.returncode == 2
    assert key in p.stderr
    assert "Ray" not in p.stderr and not (tmp_path / "r").exists()
    assert time.monotonic() - t0 < 20


def test_help_documents_every_job_key():
    from raytp.config import describe
    p = raytp("train", "--help")
    assert p.returncode == 0
    for key, *_ in describe():
        assert key in p.stdout, key


def test_readme_documents_every_job_key():
    from raytp.config import describe
    readme = (ROOT / "README.md").read_text()
    missing = [key for key, *_ in describe() if f"`{key}`" not in readme]
    assert not missing, f"README lacks job keys: {missing}"
