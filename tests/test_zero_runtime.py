"""The distributed optimizer on Ray: a SIGKILLed rank under zero 1 (whose AdamW rows no other rank holds) is
restored from the newest snapshot, every rank rolled back and the steps replayed, and the run ends bit for
bit where an uninterrupted zero 0 run does (the checkpoint of every rank's rows read back as one device).
A live resize under zero 1 is refused with what to do instead, and the job trains on."""
import dataclasses
import io
import json
import os
import random
import signal

import pytest

from helpers import (RECOVERY_STEPS, assert_bitwise_equal, events, final_state, job, recovery_job, run, signal_rank)
from raytp.files import checkpoint
from raytp.runtime.driver.driver import Driver

pytestmark = pytest.mark.slow  # two jobs of four workers


def zero1(cfg):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=1))


def test_sigkill_under_zero1_restores_from_the_snapshot_and_ends_as_zero0(ray_local, recovery_reference, tmp_path):
    reference = recovery_reference(2, 2)  # zero 0's uninterrupted run (test_recovery's too, in a whole run)
    rng = random.Random(f"zero{os.environ.get('RAYTP_TEST_SEED', '')}")
    rank, step = rng.randrange(4), rng.randrange(2, RECOVERY_STEPS - 4)
    run_dir = tmp_path / "run"
    run(zero1(recovery_job(2, 2)), run_dir, "z1kill", faults=[(step, signal_rank(rank, signal.SIGKILL))])
    assert_bitwise_equal(final_state(run_dir), reference)
    (fail,), (rec,) = events(run_dir, "failure"), events(run_dir, "recovered")
    assert fail["rank"] == rank and fail["cause"] == "died", f"killed rank {rank} after step {step}"
    assert rec["source"] == "snapshot", rec  # no replica holds a rank's rows of the AdamW state
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(RECOVERY_STEPS))
    ckpt = checkpoint.find(str(run_dir / "checkpoints"))
    assert ckpt.manifest["layout"]["zero"] == 1 and len(ckpt.manifest["files"]) == 4  # every rank wrote


def test_a_live_resize_under_zero1_is_refused_and_the_job_trains_on(ray_local, tmp_path):
    d = Driver(zero1(job(1, 2, steps=3)), tmp_path / "run", "z1scale", out=io.StringIO())
    try:
        d.start()
        d.train_loop(until=1)
        for tp, dp in ((1, 1), (2, 2)):
            outcome = d.resize(tp, dp)
            assert not outcome.ok and "not supported yet" in outcome.error and "resume" in outcome.error
        assert (d.layout.tp, d.layout.dp, d.layout.zero) == (1, 2, 1)
        d.train_loop()
        assert d.step == 3
    finally:
        d.release()
        d.log.close()
