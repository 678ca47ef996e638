"""Expert parallelism through the runtime (an MoE Llama, 4 experts, top 2): at TP=1 x DP=2 x EP=2 each worker
holds two experts; each expert is written to the checkpoint once, by the rank holding it, and read back at any
layout: a run at TP=2 x DP=2 x EP=2 with whole experts per TP rank (etp 1) resumes from it and goes on as the
unbroken run did, and its own checkpoint resumes on one device; a live EP change both ways tracks the
unresized run, at DP=4 under zero 1 too (a killed rank of that layout is healed from its expert-DP twin:
test_random_faults); live DP, TP (to ep 1) and PP changes of an EP job under zero 1 track it too. Under the distributed
optimizer at TP=1 x DP=2 x EP=2 (zero 1: each rank its rows of the dense AdamW state, its experts' whole) a
SIGKILLed and then a SIGSTOPped rank are restored from their snapshots bit for bit, and the run's checkpoint
resumes at EP=4 and on one device (at an expert-DP group of two: tests/test_moe_zero_experts.py)."""
import dataclasses
import io
import json
import signal

import numpy as np
import pytest

from helpers import (EP_STEPS, FIXED, RECOVERY_STEPS, SMALL_MOE, assert_bitwise_equal, ep_job, events, final_state,
                     losses, parallel, recovery_job, resume_run, run, signal_rank)
from reference_runs import unbroken_run
from raytp.files import checkpoint
from raytp.runtime.driver.driver import Driver

STEPS = EP_STEPS

@pytest.fixture(scope="module")
def reference(ray_local, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ep-ref")
    unbroken_run(ep_job(1, 2, 2), run_dir, "epref")  # forked ranks, no Ray (tests/reference_runs.py)
    return run_dir


@pytest.mark.slow
def test_each_expert_is_written_once_by_the_rank_holding_it(reference):
    m = json.loads((reference / "checkpoints" / checkpoint.step_dir(STEPS) / "manifest.json").read_text())
    for j, dp in ((0, 0), (1, 0), (2, 1), (3, 1)):  # experts 0-1 on DP rank 0, 2-3 on DP rank 1
        entry = m["tensors"][f"model/layers.1.mlp.experts.{j}.up_proj.weight"]
        assert entry["dp"] == dp and entry["shape"] == [32, 64]
    assert sorted(m["files"]) == ["tp000-dp001.safetensors", "tp000.safetensors"]


@pytest.mark.slow
def test_checkpoints_move_between_expert_layouts_and_one_device(reference, tmp_path):
    """EP=2 over DP -> TP=2 x DP=2 x EP=2 with whole experts (each on one TP rank) -> one device."""
    theirs = np.array(losses(reference))
    etp1 = ep_job(2, 2, 2, etp=1)
    etp1 = dataclasses.replace(etp1, checkpoint=dataclasses.replace(etp1.checkpoint, every=2))
    resume_run(etp1, reference / "checkpoints" / checkpoint.step_dir(4), tmp_path / "etp1", "epetp1")
    ours = np.array(losses(tmp_path / "etp1"))
    assert len(ours) == STEPS - 4 and (np.abs(ours - theirs[4:]) / theirs[4:]).max() < 1e-4
    m = json.loads((tmp_path / "etp1" / "checkpoints" / checkpoint.step_dir(STEPS) / "manifest.json").read_text())
    assert m["tensors"]["model/layers.0.mlp.experts.3.gate_proj.weight"]["tp_file"] == 1  # TP rank 1 holds 2-3
    resume_run(ep_job(1, 1, 1), tmp_path / "etp1" / "checkpoints" / checkpoint.step_dir(6), tmp_path / "one", "epone")
    one = np.array(losses(tmp_path / "one"))
    assert len(one) == STEPS - 6 and (np.abs(one - theirs[6:]) / theirs[6:]).max() < 1e-4


@pytest.mark.slow
def test_a_live_ep_change_both_ways_tracks_the_unresized_run(reference, tmp_path):
    """TP=1 x DP=2: EP 2 -> 1 after step 2 (each rank gains the two experts it lacked, from the other) and
    1 -> 2 after step 5 (each keeps its own two), every process kept; an EP degree the mesh cannot take is
    refused and the run goes on. Then DP 2 -> 4 after step 6 and back after step 7, the two first replicas'
    processes kept (zero 0: the new replicas take their dense weights and their experts from the ranks holding
    them)."""
    d = Driver(ep_job(1, 2, 2), tmp_path / "run", "epresize", out=io.StringIO())
    try:
        d.start()
        d.train_loop(until=2)
        before = d.logits(FIXED)
        outcome = d.resize(ep=4)  # four experts' EP needs dp x tp >= 4
        assert not outcome.ok and "must divide dp x tp" in outcome.error
        assert float((d.logits(FIXED) - before).abs().max()) == 0.0
        outcome = d.resize(ep=1)
        assert outcome.ok and outcome.bytes > 0 and d.layout.ep == 1, outcome
        assert float((d.logits(FIXED) - before).abs().max()) == 0.0  # the same model, all of it on each rank
        d.train_loop(until=5)
        outcome = d.resize(ep=2)
        assert outcome.ok and outcome.bytes == 0 and d.layout.ep == 2, outcome
        d.train_loop(until=6)
        for dp, until in ((4, 7), (2, None)):
            outcome = d.resize(dp=dp)
            assert outcome.ok and d.layout.dp == dp, outcome
            d.train_loop(until=until)
    finally:
        d.release()
        d.log.close()
    resized = events(tmp_path / "run", "resized")
    assert [(e["old"].get("ep", 1), e["new"].get("ep", 1), e["new"]["dp"]) for e in resized] == [
        (2, 1, 2), (1, 2, 2), (2, 2, 4), (2, 2, 2)], resized
    pids = [{r["rank"]: r["pid"] for r in e["ranks"]} for e in events(tmp_path / "run", "placed")]
    assert len(pids[-1]) == 2 and all(p[r] == pids[0][r] for p in pids for r in (0, 1)), pids  # never restarted
    ours, theirs = np.array(losses(tmp_path / "run")), np.array(losses(reference))
    assert len(ours) == STEPS and np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4


@pytest.mark.slow
def test_a_live_ep_change_under_zero1_at_dp4_tracks_the_unbroken_run(ray_local, shared_run, tmp_path):
    """TP=1 x DP=4 x EP=2 under zero 1 (ranks 0 and 2 hold experts 0-1, ranks 1 and 3 experts 2-3), EP 2 -> 4
    -> 2 live: each rank's dense AdamW rows stay, experts move with theirs, and the run tracks the unbroken
    zero-0 run. (A killed rank of this layout healed from its expert-DP twin, bit for bit: test_random_faults.)"""
    cfg = recovery_job(1, 4, model=SMALL_MOE)
    ref = shared_run("ref-ep2-dp4", parallel(cfg, ep=2))
    d = Driver(parallel(cfg, ep=2, zero=1), tmp_path / "z1", "ep4z1", out=io.StringIO())
    try:
        d.start()
        for until, ep in ((2, 4), (5, 2)):
            d.train_loop(until=until)
            outcome = d.resize(ep=ep)
            assert outcome.ok and d.layout.ep == ep, outcome
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    ours, theirs = np.array(losses(tmp_path / "z1")), np.array(losses(ref))
    assert len(ours) == RECOVERY_STEPS and np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4


@pytest.mark.slow
def test_live_dp_tp_and_pp_changes_of_an_ep_job_under_zero1_track_the_unresized_run(ray_local, shared_run, tmp_path):
    """TP=1 x DP=2 x EP=2 under zero 1, changed live while it trains: DP 2 -> 4 after step 4 (in place: the two
    first replicas keep their processes and re-cut their dense and expert AdamW rows, over DP 4 and expert-DP 2),
    to TP=2 x DP=2 with the experts back in the dense mesh (ep 1: their AdamW state in the optimizer's DP rows)
    after step 8, to PP=2 x DP=2 x EP=2 after step 12: each a restage (every worker of the new layout started
    ahead, the planner moving the weights, the experts and every AdamW row); the loss tracks the unresized run's
    within 1e-5."""
    cfg = parallel(recovery_job(1, 2, model=SMALL_MOE), ep=2, zero=1)
    ref = shared_run("ref-ep2-dp2-z1", cfg)
    half = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, cpus_per_worker=0.5))  # two layouts
    d = Driver(half, tmp_path / "run", "epz1resize", out=io.StringIO())
    phases = ((4, {"dp": 4}), (8, {"tp": 2, "dp": 2, "ep": 1}), (12, {"tp": 1, "pp": 2, "ep": 2}))
    try:
        d.start()
        for until, degrees in phases:
            d.train_loop(until=until)
            outcome = d.resize(**degrees)
            assert outcome.ok and outcome.bytes > 0, outcome
            assert all(getattr(d.layout, k) == v for k, v in degrees.items()), d.layout
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    pids = [{r["rank"]: r["pid"] for r in e["ranks"]} for e in events(tmp_path / "run", "placed")]
    assert len(pids[1]) == 4 and all(pids[1][r] == pids[0][r] for r in (0, 1)), pids  # DP 2 -> 4 kept them
    resized = events(tmp_path / "run", "resized")
    assert [{k: e["new"].get(k, 1) for k in ("tp", "pp", "dp", "ep")} for e in resized] == [
        {"tp": 1, "pp": 1, "dp": 4, "ep": 2}, {"tp": 2, "pp": 1, "dp": 2, "ep": 1}, {"tp": 1, "pp": 2, "dp": 2, "ep": 2}]
    ours, theirs = np.array(losses(tmp_path / "run")), np.array(losses(ref))
    assert len(ours) == RECOVERY_STEPS and np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-5


@pytest.mark.slow
def test_zero1_at_ep2_heals_kills_and_hangs_bit_for_bit_and_its_checkpoint_moves(reference, tmp_path):
    """TP=1 x DP=2 x EP=2 under zero 1: no rank holds another's AdamW rows or experts, so rank 1 (SIGKILLed
    after step 2) and rank 0 (SIGSTOPped after step 5) come back from their snapshots, and the run ends as the
    zero-0 run does, bit for bit (the distributed optimizer's sums are the replicated one's on gloo). Its
    step-4 checkpoint (dense AdamW rows in blocks over DP, experts whole) resumes at TP=1 x DP=4 x EP=4 and on
    one device, tracking it."""
    run_dir = tmp_path / "run"
    # The heartbeat finds the hang (recovery.hang_s); the step deadline (ep_job's) is the last resort.
    run(ep_job(1, 2, 2, zero=1, ping_timeout_s=2.0), run_dir, "ep2z1faults",
        faults=[(2, signal_rank(1, signal.SIGKILL)), (5, signal_rank(0, signal.SIGSTOP))])
    fails, recs = events(run_dir, "failure"), events(run_dir, "recovered")
    assert [(f["rank"], f["cause"]) for f in fails] == [(1, "died"), (0, "hung")], fails
    assert [r["source"] for r in recs] == ["snapshot"] * 2, recs
    assert_bitwise_equal(final_state(run_dir, STEPS), final_state(reference, STEPS))
    assert losses(run_dir) == losses(reference)
    m = json.loads((run_dir / "checkpoints" / checkpoint.step_dir(4) / "manifest.json").read_text())
    blocks = {k: e["blocks"] for k, e in m["tensors"].items() if "blocks" in e}  # dense AdamW rows over DP
    assert {d for b in blocks.values() for d, _, _ in b} == {0, 1} and not any(".experts." in k for k in blocks)
    theirs = np.array(losses(reference))
    for name, (tp, dp, ep) in {"ep4": (1, 4, 4), "one": (1, 1, 1)}.items():
        resume_run(ep_job(tp, dp, ep), run_dir / "checkpoints" / checkpoint.step_dir(4), tmp_path / name, name)
        ours = np.array(losses(tmp_path / name))
        assert len(ours) == STEPS - 4 and (np.abs(ours - theirs[4:]) / theirs[4:]).max() < 1e-4, name
