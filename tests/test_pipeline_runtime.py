"""Pipeline stages on the Ray runtime: a PP=2 (x DP=2) job trains like PP=1, writes one checkpoint file per
(stage, TP rank) under global tensor names that reads back whole; a TP=2 x PP=2 checkpoint resumes at
TP=1 x PP=3 and at one device and a one-device one at PP=2, each going on as the run that wrote it did, and
at the same layout bit for bit; a SIGKILLed middle stage with no replica is restored from its snapshot, bit for
bit (kills and hangs of any stage at PP=2 x DP=2: tests/test_random_faults.py)."""
import dataclasses
import signal

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # Ray runs of 2 to 4 workers each

from helpers import FIXED, assert_bitwise_equal, close, drive, events, final_state, job, losses, run, signal_rank
from reference_runs import unbroken_run
from raytp.files import checkpoint
from raytp.runtime.driver.driver import Driver
from raytp.runtime.origin import from_checkpoint

STEPS = 8
MODEL = {"n_layer": 3}  # 3 layers on 2 stages: an uneven split


def pp_job(pp, dp=1, steps=STEPS, tp=1, every=None, step_timeout_s=30.0, **recovery):
    """A checkpoint at the end (and every `every` steps), a snapshot after every step."""
    cfg = job(tp, dp, model=MODEL, steps=steps, checkpoint={"every": every or steps, "keep": 3},
              recovery={"snapshot_every": 1, **recovery}, step_timeout_s=step_timeout_s)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=pp))


def resumed(cfg, location, run_dir, name):
    """Run `cfg` from the checkpoint at `location` to its end; the Driver's run dir."""
    d = Driver(cfg, run_dir, name, out=open("/dev/null", "w"), init_state=from_checkpoint(str(location)))
    try:
        d.start()
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    return run_dir


def staged(pp, tmp_path_factory):
    """PP=pp for STEPS + 2 steps, a checkpoint at STEPS and at the end: (run dir, logits at the seeded start)."""
    run_dir = tmp_path_factory.mktemp(f"pp{pp}") / "run"
    d, start_logits, _ = drive(pp_job(pp, steps=STEPS + 2, every=STEPS), run_dir, f"pp{pp}ref")
    close(d)
    return run_dir, start_logits


@pytest.fixture(scope="module")
def one_stage(ray_local, tmp_path_factory):
    return staged(1, tmp_path_factory)


@pytest.fixture(scope="module")
def two_stages(ray_local, tmp_path_factory):
    return staged(2, tmp_path_factory)


def test_two_stages_train_like_one_and_write_a_file_per_stage(one_stage, two_stages):
    (two, _), (one, _) = two_stages, one_stage
    a, b = np.array(losses(two)), np.array(losses(one))
    assert len(a) == STEPS + 2 and np.abs(a - b).max() / b.max() < 1e-5, (a, b)
    ckpt = checkpoint.find(str(two / "checkpoints"))
    assert sorted(ckpt.manifest["files"]) == ["pp000-tp000.safetensors", "pp001-tp000.safetensors"]
    assert ckpt.manifest["layout"] == {"tp": 1, "pp": 2, "dp": 1}
    stages = {k.split("/")[1]: v["stage"] for k, v in ckpt.manifest["tensors"].items()}
    assert stages["wte.weight"] == 0 and stages["h.0.ln_1.weight"] == 0 and stages["ln_f.weight"] == 1
    whole, ref = final_state(two, STEPS + 2), final_state(one, STEPS + 2)
    assert whole["model"].keys() == ref["model"].keys()  # the tied copy is stored once, by the first stage
    for name in ref["model"]:
        diff = float((whole["model"][name] - ref["model"][name]).abs().max())
        assert diff < 1e-4, f"{name} differs by {diff:.2e}"


@pytest.fixture(scope="module")
def tp2_pp2(ray_local, tmp_path_factory):
    """TP=2 x PP=2 (4 workers) for STEPS + 2 steps, a checkpoint at STEPS and at the end."""
    run_dir = tmp_path_factory.mktemp("tp2pp2") / "run"
    run(pp_job(2, tp=2, steps=STEPS + 2, every=STEPS), run_dir, "tp2pp2")
    return run_dir


@pytest.mark.parametrize("tp, pp", [(1, 3), (1, 1), (2, 2)])
def test_a_tp2_pp2_checkpoint_resumes_at_any_layout(tp2_pp2, tp, pp, tmp_path):
    """Resumed at step STEPS at TP x PP: its two steps' losses are those of the run that wrote it (within
    1e-5), and at the writer's own layout its final state is that run's, bit for bit."""
    ckpt = tp2_pp2 / "checkpoints" / checkpoint.step_dir(STEPS)
    assert "pp001-tp001.safetensors" in checkpoint.find(str(ckpt)).manifest["files"]
    run_dir = resumed(pp_job(pp, tp=tp, steps=STEPS + 2, every=STEPS + 2), ckpt, tmp_path / "run", f"res{tp}{pp}")
    got, want = np.array(losses(run_dir)), np.array(losses(tp2_pp2)[STEPS:])
    assert len(got) == 2 and np.abs(got - want).max() / want.max() < 1e-5, (got, want)
    if (tp, pp) == (2, 2):
        assert_bitwise_equal(final_state(run_dir, STEPS + 2), final_state(tp2_pp2, STEPS + 2))


def test_a_one_device_checkpoint_resumes_at_two_stages(one_stage, tmp_path):
    """Written by the PP=1 run at step STEPS, resumed at PP=2 for its two last steps: their losses are
    those of the PP=1 run that wrote it (within 1e-5)."""
    one, _ = one_stage
    a = resumed(pp_job(2, steps=STEPS + 2, every=STEPS + 2), one / "checkpoints" / checkpoint.step_dir(STEPS),
                tmp_path / "a", "res1to2")
    la, lb = np.array(losses(a)), np.array(losses(one)[STEPS:])
    assert len(la) == 2 and np.abs(la - lb).max() / lb.max() < 1e-5, (la, lb)


def test_sigkill_of_a_middle_stage_without_a_replica_restores_from_the_snapshot(ray_local, tmp_path):
    """PP=3, one replica: the middle stage's rank has no DP replica; its snapshot part restores it."""
    ref = tmp_path / "ref"
    unbroken_run(pp_job(3), ref, "pp3ref")  # forked ranks, no Ray (tests/reference_runs.py)
    run(pp_job(3), tmp_path / "run", "pp3kill", faults=[(4, signal_rank(1, signal.SIGKILL))])
    (fail,), (rec,) = events(tmp_path / "run", "failure"), events(tmp_path / "run", "recovered")
    assert fail["rank"] == 1 and rec["source"] == "snapshot"
    assert_bitwise_equal(final_state(tmp_path / "run", STEPS), final_state(ref, STEPS))


def test_a_two_stage_model_gives_the_logits_of_one(one_stage, two_stages):
    """Driver.logits at PP=2 (through both stages) and at PP=1, on the same seeded weights (before step 0)."""
    got = {1: one_stage[1], 2: two_stages[1]}
    assert got[1].shape == got[2].shape == (FIXED.shape[0], FIXED.shape[1], 256)
    assert float((got[1] - got[2]).abs().max()) < 1e-5
