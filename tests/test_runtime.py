"""The Ray runtime: training through actor calls equals one device, and the same job's ranks forked without
Ray (tests/reference_runs.py, the suite's shared references) bit for bit."""
import io
import json

import numpy as np
import pytest

from helpers import assert_bitwise_equal, final_state, job, losses, one_device_losses, ray_actors
from raytp.runtime.driver.driver import Driver


def small_job(tp, dp):
    """The small job, checkpointed once at its end (as a reference run is)."""
    steps = job().train.steps
    return job(tp, dp, checkpoint={"every": steps, "keep": 1})


def trained(tp, dp, run_dir):
    """Train the small job at tp x dp through a Driver (its workers named by rank, none left after release):
    its run dir."""
    run = f"eq-tp{tp}-dp{dp}"
    d = Driver(small_job(tp, dp), run_dir / run, run, out=io.StringIO())
    try:
        d.start()
        names = ray_actors(f"raytp.{run}.rank")
        assert sorted(names) == [f"raytp.{run}.rank{r}" for r in range(tp * dp)]
        d.train_loop(0.0)
    finally:
        d.release()
        d.log.close()
    assert not ray_actors(f"raytp.{run}."), "workers left alive after release"
    return run_dir / run


@pytest.fixture(scope="module")
def ray_runs(ray_local, tmp_path_factory):
    """ray_runs(tp, dp): the run dir of the small job trained through Ray at tp x dp, once per module."""
    done = {}

    def of(tp, dp):
        if (tp, dp) not in done:
            done[(tp, dp)] = trained(tp, dp, tmp_path_factory.mktemp(f"tp{tp}dp{dp}"))
        return done[(tp, dp)]
    return of


@pytest.fixture(scope="module")
def one_device(ray_local):  # (ray_local: for the Ray runs of the tests that ask for this reference)
    ref = np.array(one_device_losses(job(1, 1)))  # a Worker outside Ray: the same steps as a one-rank run's
    assert len(ref) == 12 and ref[-1] < ref[0]
    return ref


# TP=2 x DP=2 holds both kinds; TP=2 alone is the slow tier's (test_gpt_tp's TP=2 is the quick tier's, without Ray).
@pytest.mark.parametrize("tp, dp", [(2, 2), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_tp_and_dp_runs_equal_one_device(one_device, ray_runs, tp, dp):
    rel = np.abs(np.array(losses(ray_runs(tp, dp))) - one_device) / one_device
    assert rel.max() < 1e-5, f"TP={tp} x DP={dp}: loss differs from one device by {rel.max():.2e}"


def test_the_same_job_in_forked_ranks_is_the_ray_run_bit_for_bit(ray_runs, tmp_path):
    """What the suite's shared references rest on (conftest's shared_run): TP=2 x DP=2 trained by Workers in
    forked processes, taking the driver's calls, writes every step's figures, every validation loss and the final
    checkpoint of the Ray run, bit for bit."""
    from reference_runs import unbroken_run
    cfg = small_job(2, 2)
    unbroken_run(cfg, tmp_path / "forked", "forked")
    fields = ("step", "loss", "lr", "grad_norm", "tokens", "val_loss")
    ours, theirs = ([{k: m.get(k) for k in fields} for m in map(json.loads, open(d / "metrics.jsonl"))]
                    for d in (tmp_path / "forked", ray_runs(2, 2)))
    assert ours == theirs and len(ours) == cfg.train.steps and any(m["val_loss"] is not None for m in ours)
    steps = cfg.train.steps
    assert_bitwise_equal(final_state(tmp_path / "forked", steps), final_state(ray_runs(2, 2), steps))
