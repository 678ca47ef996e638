"""Context parallelism through Ray: a CP=2 run trains like the same job at cp 1, and a SIGKILLed CP rank is
replaced and the run ends with the very weights of an unbroken CP=2 run, every step's record once. (Its pieces
against one device: test_context_parallel.py, test_context_parallel_training.py.)"""
import signal

import numpy as np
import pytest

from helpers import (RECOVERY_STEPS, assert_bitwise_equal, events, final_state, losses, parallel, recovery_job, run,
                     signal_rank, steps_logged)


@pytest.mark.slow
def test_a_cp2_run_trains_like_cp1_and_a_killed_cp_rank_heals_bit_for_bit(ray_local, tmp_path):
    one = recovery_job(1, 1)
    two = parallel(one, cp=2)
    for name, cfg, faults in (("cp1", one, ()), ("cp2", two, ()),
                              ("cp2kill", two, ((RECOVERY_STEPS // 2, signal_rank(1, signal.SIGKILL)),))):
        run(cfg, tmp_path / name, name, faults)
    a, b, c = (np.array(losses(tmp_path / n)) for n in ("cp1", "cp2", "cp2kill"))
    assert len(a) == len(b) == RECOVERY_STEPS and np.abs(b - a).max() / np.abs(a).max() < 1e-5
    assert steps_logged(tmp_path / "cp2kill") == RECOVERY_STEPS and np.array_equal(b, c)
    recovered = events(tmp_path / "cp2kill", "recovered")
    assert len(recovered) == 1 and recovered[0]["lost_steps"] == 0
    assert_bitwise_equal(final_state(tmp_path / "cp2kill"), final_state(tmp_path / "cp2"))
