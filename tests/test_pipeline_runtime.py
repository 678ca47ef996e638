"""Pipeline stages on the Ray runtime: a PP=2 (x DP=2) job trains like PP=1, writes one checkpoint file per
(stage, TP rank) under global tensor names that reads back whole (so at any layout), resumes at PP=1, and a
SIGKILLed last-stage worker is replaced with nothing lost, bit for bit."""
import dataclasses
import signal

import numpy as np
import pytest

from helpers import assert_bitwise_equal, events, final_state, job, losses, run, signal_rank
from raytp.files import checkpoint
from raytp.runtime.driver.driver import Driver
from raytp.runtime.origin import from_checkpoint

STEPS = 8
MODEL = {"n_layer": 3}  # 3 layers on 2 stages: an uneven split


def pp_job(pp, dp=1, steps=STEPS, **recovery):
    """A checkpoint at the end, a snapshot after every step."""
    cfg = job(1, dp, model=MODEL, steps=steps, checkpoint={"every": steps, "keep": 2},
              recovery={"snapshot_every": 1, **recovery}, step_timeout_s=30.0)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=pp))


@pytest.fixture(scope="module")
def one_stage(ray_local, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pp1") / "run"
    run(pp_job(1), run_dir, "pp1ref")
    return run_dir


@pytest.fixture(scope="module")
def two_stages(ray_local, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pp2") / "run"
    run(pp_job(2), run_dir, "pp2ref")
    return run_dir


def test_two_stages_train_like_one_and_write_a_file_per_stage(one_stage, two_stages):
    a, b = np.array(losses(two_stages)), np.array(losses(one_stage))
    assert len(a) == STEPS and np.abs(a - b).max() / b.max() < 1e-5, (a, b)
    ckpt = checkpoint.find(str(two_stages / "checkpoints"))
    assert sorted(ckpt.manifest["files"]) == ["pp000-tp000.safetensors", "pp001-tp000.safetensors"]
    assert ckpt.manifest["layout"] == {"tp": 1, "pp": 2, "dp": 1}
    stages = {k.split("/")[1]: v["stage"] for k, v in ckpt.manifest["tensors"].items()}
    assert stages["wte.weight"] == 0 and stages["h.0.ln_1.weight"] == 0 and stages["ln_f.weight"] == 1
    whole, ref = final_state(two_stages, STEPS), final_state(one_stage, STEPS)
    assert whole["model"].keys() == ref["model"].keys()  # the tied copy is stored once, by the first stage
    for name in ref["model"]:
        diff = float((whole["model"][name] - ref["model"][name]).abs().max())
        assert diff < 1e-4, f"{name} differs by {diff:.2e}"


def test_a_two_stage_checkpoint_resumes_at_one_stage(two_stages, tmp_path):
    """Written at PP=2, resumed at PP=1: the first step after it trains on the same weights (the loss of
    step 8 from the resumed run equals the PP=2 run's, which reads the same file)."""
    cfg = pp_job(1, steps=STEPS + 2)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, every=0))
    d = Driver(cfg, tmp_path / "run", "pp1resume", out=open("/dev/null", "w"),
               init_state=from_checkpoint(str(two_stages / "checkpoints" / checkpoint.step_dir(STEPS))))
    try:
        d.start()
        assert d.step == STEPS
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    assert len(losses(tmp_path / "run")) == 2


def test_sigkill_of_the_last_stage_loses_nothing(two_stages, tmp_path):
    run(pp_job(2, dp=2), tmp_path / "run", "pp2kill", faults=[(3, signal_rank(3, signal.SIGKILL))])
    (fail,), (rec,) = events(tmp_path / "run", "failure"), events(tmp_path / "run", "recovered")
    assert fail["rank"] == 3 and rec["lost_steps"] == 0
    healed = final_state(tmp_path / "run", STEPS)
    unhurt = tmp_path / "unhurt"
    run(pp_job(2, dp=2), unhurt, "pp2dp2")
    assert_bitwise_equal(healed, final_state(unhurt, STEPS))
