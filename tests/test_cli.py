"""`raytp train` as a user runs it: a fresh process, the default job, an embedded Ray."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"step", "loss", "lr", "tokens", "step_time_s", "tokens_per_s", "tp", "dp", "tflops", "mfu",
            "peak_mem_bytes", "data_s", "comm_s", "comm_hidden_s"}


def raytp(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "raytp.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow  # the default job: a minute or two on 2 cores
def test_default_job_trains_heals_a_killed_worker_and_writes_run_dir(tmp_path):
    """The default job at DP=2, a worker SIGKILLed mid-run: it heals and ends with every step in the run dir,
    one [raytp] line per event, and none of Ray's `Unhandled error` reports of the aborts raytp expects and
    handles (without the driver reading them, DP=2 showed two per failure)."""
    import signal
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "raytp.cli", "train", "jobs/default.yaml", "--set", "train.steps=40",
                             "--set", "train.eval_interval=20", "--set", "parallel.dp=2", "--run-dir", str(run_dir)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # a ceiling for "never", far past a loaded machine
        while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 8:
            assert time.monotonic() < deadline and proc.poll() is None, "the run did not train"
            time.sleep(0.1)
        placed = [json.loads(line) for line in open(run_dir / "events.jsonl") if '"placed"' in line][-1]
        os.kill(placed["ranks"][1]["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "recovered in" in err, err[-3000:]
    assert "Unhandled error" not in err, err[-3000:]
    assert f"run run  dir {run_dir}" in err
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(40))
    assert all(REQUIRED <= m.keys() for m in metrics)
    assert metrics[0]["tp"] == 2 and metrics[0]["dp"] == 2
    assert sum(m["loss"] for m in metrics[-5:]) / 5 < metrics[0]["loss"] - 1.0, "loss did not fall"
    events = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished" and all("time" in e for e in events)
    assert kinds.count("failure") >= 1 and kinds.count("recovered") == 1
    assert all(m["tflops"] > 0 and m["mfu"] is None and m["peak_mem_bytes"] > 2**20 for m in metrics)  # cpu
    assert sum(m["comm_hidden_s"] for m in metrics) > 0  # TP=2: entry collectives behind the weight gradients
    (memory,) = [e for e in events if e["kind"] == "memory"]  # measured against the start line's estimate
    assert memory["where"] == "host" and 0.2 < memory["ratio"] < 5, memory
    assert (run_dir / "config.yaml").exists()
    assert "step 40/40" in err


# Each case is a fresh process (~2 s): the quick tier keeps one config rule and one file check. The other
# rules are test_config's, in this process; most are test_api's too, through this command's code (CliRunner).
SLOW = pytest.mark.slow


@pytest.mark.parametrize("args, key", [
    (["--set", "parallel.tp=3"], "parallel.tp"),
    pytest.param(["--set", "train.stepz=3"], "train.stepz", marks=SLOW),
    pytest.param(["--set", "train.lr=abc"], "train.lr", marks=SLOW),
    pytest.param(["--set", "model.n_layer=0"], "model.n_layer", marks=SLOW),
    pytest.param(["--set", "train.batch_size=7", "--set", "parallel.dp=2"], "train.batch_size", marks=SLOW),
    (["--set", "data.source=/nonexistent/corpus"], "data.source"),
])
def test_bad_job_exits_before_ray_starts(args, key, tmp_path):
    t0 = time.monotonic()
    p = raytp("train", "jobs/default.yaml", *args, "--run-dir", str(tmp_path / "r"))
    assert p.returncode == 2
    assert key in p.stderr
    assert "Ray" not in p.stderr and not (tmp_path / "r").exists()
    assert time.monotonic() - t0 < 60  # before Ray: a loaded machine's python start, no Ray start


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


@pytest.mark.slow
def test_a_short_try_shortens_the_warmup_with_one_warning(tmp_path):
    run_dir = tmp_path / "short"
    p = raytp("train", "jobs/default.yaml", "--set", "train.steps=3", "--set", "model.n_layer=1",
              "--run-dir", str(run_dir))
    assert p.returncode == 0, p.stderr[-3000:]
    warnings = [line for line in p.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: train.warmup_steps=20 exceeds train.steps=3; warming up over all 3 steps instead"]
    assert "step 3/3" in p.stderr


@pytest.mark.parametrize("args, key, code", [  # the slow ones: also test_api's, through this command's code
    pytest.param(["--set", "model.vocab_size=100"], "model.vocab_size", 2, marks=SLOW),  # byte ids up to 255
    (["--set", "checkpoint.dir=/etc/passwd/ckpt"], "checkpoint.dir", 2),   # under a file: not writable
    pytest.param(["--set", "checkpoint.dir=nosuch://x"], "checkpoint.dir", 2, marks=SLOW),
    (["--set", "model.block_size=100000000"], "model.block_size", 2),   # no node can hold a worker
])
def test_refusals_name_the_key_in_one_line_and_leave_nothing(args, key, code, tmp_path):
    p = raytp("train", "jobs/default.yaml", *args, "--run-dir", str(tmp_path / "r"))
    assert p.returncode == code, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and key in errors[0], p.stderr
    assert "Traceback" not in p.stderr and "Ray" not in p.stderr and not (tmp_path / "r").exists()


def test_submit_resume_is_passed_to_train_on_the_cluster(tmp_path):
    from raytp.jobs import make_submission
    sub = make_submission(ROOT / "jobs" / "default.yaml", ("train.steps=5",), "again", None, 60, tmp_path,
                          resume="s3://bucket/run/checkpoints")
    assert sub.entrypoint.endswith("--set train.steps=5 --resume s3://bucket/run/checkpoints")
    latest = make_submission(ROOT / "jobs" / "default.yaml", (), "again", "/shared/runs/a", 60, tmp_path,
                             resume="latest")
    assert latest.entrypoint.endswith("--run-dir /shared/runs/a --resume")
    p = raytp("submit", "--help")
    assert "--resume" in p.stdout


def test_scale_without_degrees_names_each_one_and_starts_nothing():
    p = raytp("scale", "somerun")
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip() == "error: give --workers N, or any of --tp N, --cp N, --pp N, --dp N, or --ep N", p.stderr
