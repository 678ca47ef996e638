"""`raytp.train` from Python: a run's Result as its run directory has it, the command line's refusals as typed
errors with its messages, and the README's Ray Tune example, run as written."""
import dataclasses
import json
import math
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import raytp
from helpers import events, job
from raytp.cli import main
from raytp.files import checkpoint
from raytp.parallel.layout import Layout

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = str(ROOT / "jobs" / "default.yaml")


def records(run_dir):
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def cli_errors(*args):
    """(exit status, the text after `error:` of each line) of `raytp ARGS`, in this process."""
    p = CliRunner().invoke(main, list(args))
    return p.exit_code, [line.removeprefix("error: ") for line in p.stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def first(ray_local, tmp_path_factory):
    """The small test job (a JobConfig, one override), a checkpoint at its end: (result, run dir)."""
    run_dir = tmp_path_factory.mktemp("api") / "small"
    result = raytp.train(job(checkpoint={"every": 12}), overrides={"train.lr": 1e-3}, run_dir=run_dir)
    return result, run_dir


def test_train_returns_the_result_of_the_run(first):
    result, run_dir = first
    metrics = records(run_dir)
    assert [m["step"] for m in metrics] == list(range(12))
    assert (result.run, result.run_dir, result.state, result.steps) == ("small", run_dir, "finished", 12)
    assert math.isfinite(result.loss) and result.loss == metrics[-1]["loss"]
    assert result.val_loss == metrics[-1]["val_loss"]
    assert result.checkpoint == str(run_dir / "checkpoints" / checkpoint.step_dir(12))
    assert checkpoint.find(result.checkpoint).step == 12
    assert result.layout == Layout(1, dp=1)
    assert list(result.events) == events(run_dir) and result.events[-1]["kind"] == "finished"
    assert "lr: 0.001" in (run_dir / "config.yaml").read_text()  # the override
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.steps = 0


def test_a_used_run_dir_is_refused(first):
    _, run_dir = first
    with pytest.raises(raytp.BadJob) as refused:
        raytp.train(job(), run_dir=run_dir)
    assert str(refused.value).startswith(f"run directory {run_dir} already holds a run; pass --resume")


@pytest.mark.parametrize("sets, key", [
    (["parallel.tp=3"], "parallel.tp"),
    (["train.stepz=3", "train.lr=abc"], "train.lr"),               # two problems, a line each
    (["data.source=/nonexistent/corpus"], "data.source"),
    (["model.vocab_size=100"], "model.vocab_size"),                 # the data has byte ids up to 255
    (["checkpoint.dir=nosuch://x"], "checkpoint.dir"),
])
def test_a_bad_job_raises_BadJob_with_the_message_the_command_prints(sets, key, tmp_path):
    with pytest.raises(raytp.BadJob) as refused:
        raytp.train(DEFAULT, sets, run_dir=tmp_path / "api")
    code, printed = cli_errors("train", DEFAULT, *[a for s in sets for a in ("--set", s)],
                               "--run-dir", str(tmp_path / "cli"))
    assert code == refused.value.exit_code == 2 and printed == str(refused.value).splitlines()
    assert key in printed[-1] and not (tmp_path / "api").exists()


@pytest.mark.parametrize("bare", [True, False])
def test_resuming_from_no_checkpoint_raises_BadJob_as_the_command_exits(bare, tmp_path):
    """resume=True is a bare --resume (the run dir's own checkpoints); a string is --resume LOCATION."""
    run_dir, where = tmp_path / "r", tmp_path / ("r" if bare else "elsewhere")
    with pytest.raises(raytp.BadJob) as refused:
        raytp.train(DEFAULT, run_dir=run_dir, resume=True if bare else str(where))
    code, printed = cli_errors("train", DEFAULT, "--run-dir", str(run_dir), "--resume", *([] if bare else [str(where)]))
    assert code == 2 and printed == str(refused.value).splitlines()
    assert printed[0].startswith(f"{where}: holds no whole checkpoint")


def test_a_run_that_fails_raises_RunFailed_with_its_cause(ray_local, tmp_path):
    """Eight workers on a 4-CPU Ray: placement gives up after a second; the run dir records the failure."""
    from raytp.runtime.errors import PlacementError
    with pytest.raises(raytp.RunFailed) as failed:
        raytp.train(job(tp=2, dp=4, placement_timeout_s=1.0), run_dir=tmp_path / "r")
    assert isinstance(failed.value.__cause__, PlacementError) and failed.value.exit_code == 1
    assert str(failed.value) == str(failed.value.__cause__).strip() and failed.value.run_dir == tmp_path / "r"
    assert events(tmp_path / "r")[-1]["kind"] == "failed"


def readme_example(heading="### Python API", marker="tune.Tuner"):
    """The README's Python block under `heading` that uses `marker`."""
    section = (ROOT / "README.md").read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", section, re.S) if marker in c]
    return code


@pytest.mark.slow  # two trials, each a Ray Tune worker process and a run
def test_the_readme_ray_tune_example_runs_a_trial_per_learning_rate(ray_local, tmp_path, monkeypatch):
    pytest.importorskip("ray.tune", reason="Ray Tune (ray[tune]) is not installed", exc_type=ImportError)
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "readme"}  # a module Ray's pickler cannot import: the trainable travels by value
    exec(compile(readme_example(), "README.md", "exec"), scope)
    results = scope["results"]
    assert results.errors == [] and len(results) == 2
    assert sorted(r.config["lr"] for r in results) == [1e-3, 3e-3]
    finals = sorted(records(f.parent)[-1]["loss"] for f in (tmp_path / "runs").glob("*/metrics.jsonl"))
    assert sorted(r.metrics["loss"] for r in results) == finals and all(map(math.isfinite, finals))
    assert all(r.metrics["steps"] == 8 for r in results)


def test_import_raytp_loads_neither_torch_nor_ray():
    script = "import sys, raytp; print(sorted({'torch', 'ray'} & set(sys.modules)), callable(raytp.train))"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["[]", "True"], p.stderr[-2000:]


def test_the_callable_raytp_train_is_still_the_training_package():
    import raytp.train.step as step
    from raytp import train
    assert train is raytp.train and step is sys.modules["raytp.train.step"] and raytp.train.step is step
    assert pickle.loads(pickle.dumps(raytp.train)) is raytp.train  # by name, as a Tune trainable's global
