"""The distributed optimizer on Ray (ranks lost under zero 1, whose AdamW rows no other rank holds, restored
from the snapshot and ending bit for bit as zero 0's unbroken run: tests/test_random_faults.py). Live resizes
under zero 1 (DP 4 -> 2, TP 1 -> 2 -> 1, DP 2 -> 4) re-cut the rows (each row a rank lacks moved once) and end
bit for bit as the same resizes at zero 0; one that fails midway rolls back to the old rows."""
import dataclasses
import io

import pytest

from faulty import DiesInTakeMoves
from helpers import assert_bitwise_equal, events, final_state, job, losses
from reference_runs import unbroken_run
from raytp.runtime.driver.driver import Driver

pytestmark = pytest.mark.slow  # two jobs of four workers


def zero1(cfg):
    """`cfg` under zero 1, its weights gathered during the next forward pass (so snapshots, checkpoints and
    resizes find gathers in flight and must settle them first)."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=1, overlap_param_gather=True))


RESIZES = [(3, 1, 2), (5, 2, 2), (7, 1, 2), (9, 1, 4)]  # (after step, TP, DP): DP 4 -> 2, TP 1 -> 2 -> 1, DP 2 -> 4
RESIZE_STEPS = 11


def resized_run(cfg, run_dir, name):
    """`cfg` through RESIZES."""
    d = Driver(cfg, run_dir, name, out=io.StringIO())
    try:
        d.start()
        for step, tp, dp in RESIZES:
            d.train_loop(until=step)
            outcome = d.resize(tp=tp, dp=dp)
            assert outcome.ok, outcome
            assert (d.layout.tp, d.layout.dp, d.layout.zero) == (tp, dp, cfg.parallel.zero)
        d.train_loop()
        assert d.step == RESIZE_STEPS
    finally:
        d.release()
        d.log.close()


def test_live_dp_and_tp_resizes_under_zero1_recut_the_rows_and_end_as_zero0_resized_alike(ray_local, tmp_path):
    cfg = job(1, 4, steps=RESIZE_STEPS, checkpoint={"every": RESIZE_STEPS, "keep": 1})
    resized_run(cfg, tmp_path / "z0", "z0scale")
    resized_run(zero1(cfg), tmp_path / "z1", "z1scale")
    assert losses(tmp_path / "z1") == losses(tmp_path / "z0")
    state = final_state(tmp_path / "z1", RESIZE_STEPS)
    assert_bitwise_equal(state, final_state(tmp_path / "z0", RESIZE_STEPS))
    n = sum(t.numel() for t in state["model"].values())
    moved = [(e["new"]["tp"], e["new"]["dp"], e["bytes"]) for e in events(tmp_path / "z1", "resized")]
    assert [m[:2] for m in moved] == [(tp, dp) for _, tp, dp in RESIZES]
    shrink, grow = moved[0][1:], moved[-1][1:]
    # The state mover moves only the rows a rank lacks (AdamW: 8 bytes a row). 4 -> 2: DP rank 0 keeps the first
    # quarter of each bucket's rows in place (its old rows), DP rank 1 has none of its new ones: 3/4 of them move.
    # 2 -> 4: the weights to 2 new ranks (8n), and again all rows but rank 0's quarter.
    slack = 4 * len(state["model"]) * 4 + 8 * n // 100  # a 4-byte step count a parameter and new rank; rounding
    assert shrink[0] == 2 and abs(shrink[1] - 6 * n) <= slack, "the AdamW rows a rank lacked did not move once each"
    assert grow[0] == 4 and abs(grow[1] - 14 * n) <= slack, "weights to 2 new ranks plus the rows each lacked"


def test_a_dp_resize_under_zero1_that_fails_midway_rolls_back_to_the_old_rows(ray_local, tmp_path):
    """DP 2 -> 4 under zero 1: the kept ranks have cut their AdamW rows anew when an added rank dies taking its
    blocks; they take back the old rows and the job goes on at DP=2, ending bit for bit as a run never resized."""
    cfg = zero1(job(1, 2, steps=6, checkpoint={"every": 6, "keep": 1}))
    unbroken_run(cfg, tmp_path / "plain", "plain")  # forked ranks, no Ray (tests/reference_runs.py)
    DiesInTakeMoves.marker = str(tmp_path / "died-once")
    d = Driver(cfg, tmp_path / "failed", "dpfail", out=io.StringIO())
    d.worker_cls = DiesInTakeMoves
    try:
        d.start()
        d.train_loop(until=3)
        outcome = d.resize(tp=1, dp=4)
        assert (tmp_path / "died-once").exists(), "the fault was not injected"
        assert not outcome.ok and "rolled back" in outcome.error, outcome
        assert d.layout.dp == 2 and d.step == 3
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    assert losses(tmp_path / "failed") == losses(tmp_path / "plain")
    assert_bitwise_equal(final_state(tmp_path / "failed", 6), final_state(tmp_path / "plain", 6))

