"""The Ray runtime: training through actor calls equals one device; placement; clean failures."""
import io
import json

import numpy as np

from conftest import ray_actors
from raytp.config import from_dict
from raytp.runtime.driver import Driver

SMALL = {
    "model": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32, "vocab_size": 256},
    "train": {"steps": 12, "batch_size": 8, "lr": 3e-3, "warmup_steps": 2, "eval_interval": 6,
              "steps_per_call": 4},
}


def job(tp=1, dp=1, model=None, steps=None, checkpoint=None, recovery=None, **runtime):
    d = json.loads(json.dumps(SMALL))
    d["parallel"] = {"tp": tp, "dp": dp}
    d["model"].update(model or {})
    d["train"]["steps"] = steps or d["train"]["steps"]
    d["runtime"] = {"placement_timeout_s": 20.0, **runtime}
    d["checkpoint"] = checkpoint or {}
    d["recovery"] = recovery or {}
    return from_dict(d)


def losses(run_dir):
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl")]


def test_tp_and_dp_runs_equal_one_device(ray_local, tmp_path):
    runs = {}
    for tp, dp in [(1, 1), (2, 1), (2, 2)]:
        run = f"eq-tp{tp}-dp{dp}"
        d = Driver(job(tp, dp), tmp_path / run, run, out=io.StringIO())
        try:
            d.start()
            names = ray_actors(f"raytp.{run}.rank")
            assert sorted(names) == [f"raytp.{run}.rank{r}" for r in range(tp * dp)]
            d.train_loop(0.0)
        finally:
            d.release()
            d.log.close()
        runs[(tp, dp)] = losses(tmp_path / run)
        assert not ray_actors(f"raytp.{run}."), "workers left alive after release"
    ref = np.array(runs[(1, 1)])
    assert len(ref) == 12 and ref[-1] < ref[0]
    for layout, ls in runs.items():
        rel = np.abs(np.array(ls) - ref) / ref
        assert rel.max() < 1e-5, f"{layout}: loss differs from one device by {rel.max():.2e}"


