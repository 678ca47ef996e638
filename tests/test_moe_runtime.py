"""The runtime on an MoE Llama (4 experts, top 2, balance loss on) at TP=2 x DP=2: a SIGKILLed worker is
healed from its DP replica with nothing lost, bit for bit; a live TP change (2 -> 1 -> 2, with DP 2) keeps
the model and tracks the unresized run; a checkpoint written at TP=2 x DP=2 resumes on one device and goes
on as the unbroken run did; every step's record has each expert layer's load and losses, and the
progress line the worst layer's imbalance; the start names the experts' kernel."""
import io
import json
import re
import signal

import numpy as np
import pytest

from helpers import FIXED, assert_bitwise_equal, events, final_state, job, losses, resume_run, run, signal_rank
from raytp.files import checkpoint
from raytp.runtime.driver.driver import Driver

MOE = {"arch": "llama", "n_head": 4, "n_kv_head": 2, "intermediate_size": 96,
       "moe": {"n_experts": 4, "top_k": 2, "moe_ffn": 32, "aux_coeff": 0.01}}
STEPS = 8


def moe_job(tp, dp):
    """A checkpoint every 4 steps, a snapshot after every step."""
    return job(tp, dp, steps=STEPS, checkpoint={"every": 4, "keep": 2}, recovery={"snapshot_every": 1},
               step_timeout_s=30.0, model=MOE)


@pytest.fixture(scope="module")
def reference(ray_local, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe-ref")
    run(moe_job(2, 2), run_dir, "moeref")
    return run_dir


def drive(cfg, run_dir, name):
    return Driver(cfg, run_dir, name, out=io.StringIO())


@pytest.mark.slow
def test_sigkill_of_an_moe_rank_is_healed_from_its_replica_bit_for_bit(reference, tmp_path):
    run(moe_job(2, 2), tmp_path / "run", "moekill", faults=[(3, signal_rank(2, signal.SIGKILL))])
    assert_bitwise_equal(final_state(tmp_path / "run", STEPS), final_state(reference, STEPS))
    (fail,), (rec,) = events(tmp_path / "run", "failure"), events(tmp_path / "run", "recovered")
    assert fail["rank"] == 2 and rec["source"] == "replica"
    assert losses(tmp_path / "run") == losses(reference)


@pytest.mark.slow
def test_live_tp_change_keeps_the_experts_and_tracks_the_unresized_run(reference, tmp_path):
    d = drive(moe_job(2, 2), tmp_path / "run", "moeresize")
    try:
        d.start()
        for i, tp in enumerate((2, 1, 2)):
            if i:
                before = d.logits(FIXED)
                outcome = d.resize(tp=tp, dp=2)
                assert outcome.ok, outcome
                assert float((d.logits(FIXED) - before).abs().max()) < 1e-5, f"logits moved at -> TP={tp}"
            d.train_loop(until=min(3 * (i + 1), STEPS))
    finally:
        d.release()
        d.log.close()
    ours, theirs = np.array(losses(tmp_path / "run")), np.array(losses(reference))
    assert len(ours) == STEPS and (np.abs(ours - theirs) / theirs).max() < 1e-4


@pytest.mark.slow
def test_checkpoint_at_tp2_dp2_resumes_on_one_device(reference, tmp_path):
    resume_run(moe_job(1, 1), reference / "checkpoints" / checkpoint.step_dir(4), tmp_path / "run", "moeresume")
    ours, theirs = np.array(losses(tmp_path / "run")), np.array(losses(reference))[4:]
    assert len(ours) == STEPS - 4 and (np.abs(ours - theirs) / theirs).max() < 1e-4


@pytest.mark.slow
def test_every_step_records_its_expert_load_and_the_progress_line_shows_it(reference):
    recs = [json.loads(line) for line in open(reference / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(STEPS))
    for r in recs:
        layers = r["experts"]
        assert set(layers) == {str(i) for i in range(job(2, 2, model=MOE).model.n_layer)}
        for f in layers.values():
            assert 0 <= f["min"] <= f["max"] and f["imbalance"] >= 1.0 and f["balance_loss"] > 0
        assert r["expert_imbalance"] == max(f["imbalance"] for f in layers.values())
        assert r["balance_loss"] == pytest.approx(sum(f["balance_loss"] for f in layers.values()))
    out = (reference.parent / "moeref.out").read_text()
    assert re.search(r"experts \d+\.\d\dx", out), out[-500:]
    assert "experts: one expert at a time on rank 0's device" in out  # the CPU's choice (raytp.models.moe.grouped)
