"""Every step has exactly one record whatever fails when: ranks that die between a step's end and its
record (at a call's last step, with the next call already submitted behind it, and inside a call; the
rank whose figures are the step's, the one that holds the loss, one that reports nothing) leave no hole
and no duplicate in metrics.jsonl or TensorBoard, and each step's record equals the unbroken run's."""
import dataclasses
import json

import numpy as np
import pytest

from helpers import RECOVERY_STEPS, assert_bitwise_equal, events, final_state, parallel, recovery_job, run

pytestmark = pytest.mark.slow  # Ray runs of four workers, each killed three times

STEPS = RECOVERY_STEPS
# helpers.SMALL's calls over 16 steps (steps_per_call 4, evaluation every 6): [0] [1-4] [5] [6-9] [10-11]
# [12-15]; the call after [1-4] and the one after [6-9] are submitted while they run (raytp.runtime.driver.
# follow_on), so a rank dying at step 4 or 9 dies at a call's last step with the next call waiting behind it.
CALL_ENDS = (4, 9)


def metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def the_same_curve(run_dir, ref_dir):
    """Every step once, in order, with the unbroken run's loss, learning rate, gradient norm and tokens."""
    got, ref = metrics(run_dir), metrics(ref_dir)
    assert [m["step"] for m in got] == list(range(STEPS)), "one record per step, none twice"
    for g, r in zip(got, ref):
        assert (g["loss"], g["lr"], g["grad_norm"], g["tokens"]) == (r["loss"], r["lr"], r["grad_norm"], r["tokens"]), g
    return got


def chaos(cfg, run_dir, name, at, tmp_path):
    from faulty import DiesAfterItsStep
    DiesAfterItsStep.at, DiesAfterItsStep.marker = at, str(tmp_path / "died")
    run(cfg, run_dir, name, worker_cls=DiesAfterItsStep)
    fails, recs = events(run_dir, "failure"), events(run_dir, "recovered")
    assert sorted((f["rank"], f["cause"]) for f in fails) == sorted((r, "died") for r in at), fails
    assert all(r["lost_steps"] == 0 for r in recs), recs
    return events(run_dir, "records_recovered")


def test_tp2_dp2_ranks_dying_between_a_step_and_its_record_leave_every_record(ray_local, recovery_reference,
                                                                              tmp_path):
    """Rank 0 (whose figures are each step's) after step 4, the last of a call; rank 3 (reports nothing) inside
    a call; rank 1 (a state owner, whose snapshot part is read each step) after step 9, a call's last. Through
    TensorBoard as well."""
    tb = tmp_path / "tb"
    cfg = recovery_job(2, 2)
    cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, tensorboard=str(tb)))
    run_dir = tmp_path / "run"
    recovered = chaos(cfg, run_dir, "recs22", {0: CALL_ENDS[0], 3: 7, 1: CALL_ENDS[1]}, tmp_path)
    assert_bitwise_equal(final_state(run_dir), recovery_reference(2, 2))
    got = the_same_curve(run_dir, recovery_reference.run_dir(2, 2))
    assert 4 in [s for e in recovered for s in e["steps"]], recovered  # rank 0's last step came from a survivor
    assert all(not e["missing"] for e in recovered), recovered

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(STEPS))
    assert np.allclose([e.value for e in acc.Scalars("loss")], [m["loss"] for m in got], rtol=1e-6)


def test_pp2_dp2_the_loss_holder_and_the_first_rank_dying_after_their_step_leave_every_record(ray_local, shared_run,
                                                                                              tmp_path):
    """PP=2 x DP=2 (ranks 0, 1: replica 0's stages; 2, 3: replica 1's): rank 1, whose record holds the loss,
    after step 4, the last of a call; rank 0 after step 9, the last of a call; rank 2 inside a call."""
    cfg = parallel(recovery_job(1, 2, model={"n_layer": 3}), pp=2)
    ref = shared_run("ref-pp2-dp2", cfg)  # (test_random_faults' too)
    run_dir = tmp_path / "run"
    recovered = chaos(cfg, run_dir, "recs2pp", {1: CALL_ENDS[0], 2: 7, 0: CALL_ENDS[1]}, tmp_path)
    assert_bitwise_equal(final_state(run_dir), final_state(ref))
    the_same_curve(run_dir, ref)
    assert all(not e["missing"] for e in recovered), recovered
