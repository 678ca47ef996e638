"""The Ray runtime: training through actor calls equals one device; placement; clean failures."""
import io

import numpy as np

from helpers import job, losses, ray_actors
from raytp.runtime.driver.driver import Driver

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


