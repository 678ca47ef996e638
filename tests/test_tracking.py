"""A run's records in the experiment trackers (tracking section), read back with each tracker's own reader:
TensorBoard's event files, MLflow's file store, W&B's offline transaction log; a resumed run goes on with
the same W&B and MLflow runs. A tracker whose library is missing is refused by name."""
import dataclasses
import glob
import json
import struct

import numpy as np
import pytest

from helpers import job, run
from raytp.config import ConfigError, from_dict
from raytp.config.tracking import MlflowTarget, WandbTarget
from raytp.runtime.origin import from_checkpoint

STEPS = 4


def wandb_history(path) -> dict[int, dict]:
    """{step: {key: value}} of a W&B transaction log (.wandb: ':W&B', magic, version, then LevelDB-log
    records in 32 KiB blocks, each a protobuf Record)."""
    from wandb.proto import wandb_internal_pb2
    data, block = open(path, "rb").read(), 32768
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):   # FULL, FIRST
            pending = chunk
        elif kind in (3, 4):  # MIDDLE, LAST
            pending += chunk
        if kind not in (1, 4) or not pending:
            continue
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(pending)
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            out.setdefault(items.get("_step"), {}).update(items)
    return out


def tracked(cfg, tmp_path):
    t = dataclasses.replace(cfg.tracking, tensorboard=str(tmp_path / "tb"), wandb=WandbTarget(project="raytp-test"),
                            mlflow=MlflowTarget(uri=f"file:{tmp_path / 'mlruns'}", experiment="t"))
    return dataclasses.replace(cfg, tracking=t)


@pytest.mark.slow  # two jobs, and W&B's service process
def test_every_step_reaches_tensorboard_wandb_and_mlflow_and_a_resume_goes_on_with_the_same_runs(
        ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store in maintenance mode
    run_dir = tmp_path / "run"
    cfg = tracked(job(1, 1, steps=STEPS, checkpoint={"every": STEPS, "keep": 1}), tmp_path)
    run(cfg, run_dir, "tracked")
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2 * STEPS))
    d = run_driver_resumed(more, run_dir)
    assert d.step == 2 * STEPS
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    losses = [m["loss"] for m in metrics]
    assert [m["step"] for m in metrics] == list(range(2 * STEPS))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("loss")] == list(range(2 * STEPS))
    assert np.allclose([e.value for e in tb.Scalars("loss")], losses, rtol=1e-6)  # stored as float32
    assert "tflops" in tb.Tags()["scalars"] and "events/finished" in tb.Tags()["scalars"]

    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert mlrun.info.run_id == (run_dir / "mlflow_run_id").read_text()  # one run, resumed
    history = sorted(client.get_metric_history(mlrun.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(2 * STEPS)) and [m.value for m in history] == losses
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["train.steps"] == str(STEPS)

    run_id = (run_dir / "wandb_run_id").read_text()
    logs = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(logs) == 2 and all(log.endswith(f"run-{run_id}.wandb") for log in logs)  # the same run, twice
    steps = {}
    for log in logs:
        for step, items in wandb_history(log).items():
            steps.setdefault(step, {}).update(items)
    assert min(wandb_history(logs[1])) == STEPS  # the resumed run logs nothing before its first step
    assert [steps[s]["loss"] for s in range(2 * STEPS)] == pytest.approx(losses, rel=1e-12)


def run_driver_resumed(cfg, run_dir):
    """The job run again in its run dir from its checkpoint (what `raytp train --resume` does)."""
    from raytp.runtime.driver.driver import Driver
    d = Driver(cfg, run_dir, "tracked", out=open(run_dir.parent / "resumed.out", "w"),
               init_state=from_checkpoint(run_dir / "checkpoints", cfg))
    d.run_to_end()
    return d


def test_a_tracker_whose_library_is_missing_is_refused_by_name(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tracking.wandb.*needs the wandb library.*raytp\[tracking\]"):
        from_dict({"tracking": {"wandb": {"project": "p"}}})
    with pytest.raises(ConfigError, match=r"tracking.mlflow: missing field 'uri'"):
        from_dict({"tracking": {"mlflow": {"experiment": "x"}}})
