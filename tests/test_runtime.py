"""The Ray runtime: training through actor calls equals one device; placement; clean failures."""
import io

import numpy as np
import pytest

from helpers import job, losses, one_device_losses, ray_actors
from raytp.runtime.driver.driver import Driver


def trained(tp, dp, run_dir):
    """Train the small job at tp x dp through a Driver (its workers named by rank, none left after release):
    its losses."""
    run = f"eq-tp{tp}-dp{dp}"
    d = Driver(job(tp, dp), run_dir / run, run, out=io.StringIO())
    try:
        d.start()
        names = ray_actors(f"raytp.{run}.rank")
        assert sorted(names) == [f"raytp.{run}.rank{r}" for r in range(tp * dp)]
        d.train_loop(0.0)
    finally:
        d.release()
        d.log.close()
    assert not ray_actors(f"raytp.{run}."), "workers left alive after release"
    return losses(run_dir / run)


@pytest.fixture(scope="module")
def one_device(ray_local):  # (ray_local: for the Ray runs of the tests that ask for this reference)
    ref = np.array(one_device_losses(job(1, 1)))  # a Worker outside Ray: the same steps as a one-rank run's
    assert len(ref) == 12 and ref[-1] < ref[0]
    return ref


# TP=2 x DP=2 holds both kinds; TP=2 alone is the slow tier's (test_gpt_tp's TP=2 is the quick tier's, without Ray).
@pytest.mark.parametrize("tp, dp", [(2, 2), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_tp_and_dp_runs_equal_one_device(one_device, tp, dp, tmp_path):
    rel = np.abs(np.array(trained(tp, dp, tmp_path)) - one_device) / one_device
    assert rel.max() < 1e-5, f"TP={tp} x DP={dp}: loss differs from one device by {rel.max():.2e}"
