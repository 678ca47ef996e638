"""Elastic resizing of a running job: TP 2 -> 4 -> 1 and DP 2 -> 1 -> 2 in one run, in memory."""
import io
import json

import numpy as np
import pytest
import ray

from faulty import DiesInResizeSetup, SlowSaves
from helpers import FIXED, events, job, losses, one_device_losses, ray_actors
from raytp.files import checkpoint
from raytp.runtime.driver.driver import Driver

PHASES = [(2, 2), (4, 2), (1, 2), (1, 1), (1, 2)]  # layouts, 4 steps each
STEPS = 4 * len(PHASES)


# The quick tests come first: they run in the shared Ray (conftest.ray_local, 4 CPUs: a TP 2 -> 4 grow
# fits), which the slow ones' ray_wide below ends for good in this module.
@pytest.mark.slow  # over 15 s: the quick tier keeps under 3 minutes
def test_invalid_requests_are_refused_and_the_job_is_untouched(ray_local, tmp_path):
    d = Driver(job(2, 1, steps=4, placement_timeout_s=2.0), tmp_path / "run", "refuse", out=io.StringIO())
    try:
        d.start()
        d.train_loop(until=2)
        pids = {a["pid"] for a in ray_actors("raytp.refuse.rank").values()}
        bad_tp = d.resize(tp=3, dp=1)
        assert not bad_tp.ok and "parallel.tp: 3 does not divide model.n_head=4; valid tp: 1, 2, 4" in bad_tp.error
        too_big = d.resize(tp=2, dp=8)  # 16 workers on 4 CPUs
        assert not too_big.ok and "could not place the workers" in too_big.error
        bad_dp = d.resize(tp=2, dp=3)
        assert not bad_dp.ok and "train.batch_size" in bad_dp.error
        assert (d.layout.tp, d.layout.dp) == (2, 1)
        assert {a["pid"] for a in ray_actors("raytp.refuse.rank").values()} == pids
        d.train_loop()
        assert d.step == 4
    finally:
        d.release()
        d.log.close()


@pytest.mark.slow  # over 10 s: the full suite's, not the quick tier's
def test_a_tp_resize_that_fails_midway_rolls_back(ray_local, tmp_path):
    """A rank the resize started dies in its setup: the job goes back to TP=2 with the same model."""
    DiesInResizeSetup.marker = str(tmp_path / "died-once")
    d = Driver(job(2, 1, steps=6, collective_timeout_s=15.0), tmp_path / "run", "rollback", out=io.StringIO())
    d.worker_cls = DiesInResizeSetup
    try:
        d.start()
        d.train_loop(until=3)
        before = d.logits(FIXED)
        outcome = d.resize(tp=4, dp=1)
        assert (tmp_path / "died-once").exists(), "the fault was not injected"
        assert not outcome.ok and "rolled back" in outcome.error, outcome
        assert (d.layout.tp, d.layout.dp) == (2, 1) and d.step == 3
        assert sorted(ray_actors("raytp.rollback.rank")) == ["raytp.rollback.rank0", "raytp.rollback.rank1"]
        assert float((d.logits(FIXED) - before).abs().max()) < 1e-6
        table = ray.util.placement_group_table()
        assert not [g for g in table.values() if ".ext" in g["name"] and g["state"] != "REMOVED"]
        d.train_loop()
        assert d.step == 6
    finally:
        d.release()
        d.log.close()
    steps = [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert steps == list(range(6))


@pytest.fixture(scope="module")
def ray_wide(no_shared_ray):
    """A local Ray with room for two layouts at once (resizes reserve the new one first)."""
    ray.init(address="local", num_cpus=12, include_dashboard=False, namespace="raytp", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_a_resize_while_a_checkpoint_is_written_commits_it_first(ray_local, tmp_path):
    """TP 2 -> 1 while the checkpoint of step 4 is still being written: the switch stops rank 1, one of its
    writers, so the save is committed first (before, its writer's call ended with the process and the run with
    `ActorDiedError` at the next boundary: the issue's `raytp scale` failure); the run goes on."""
    run_dir = tmp_path / "run"
    d = Driver(job(2, 1, steps=8, checkpoint={"every": 4, "keep": 3}), run_dir, "savingresize", out=io.StringIO())
    d.worker_cls = SlowSaves
    try:
        d.start()
        d.train_loop(until=4)
        assert d.checkpoints.pending is not None and d.checkpoints.pending.step == 4  # still being written
        outcome = d.resize(tp=1, dp=1)
        assert outcome.ok, outcome
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    assert [e["step"] for e in events(run_dir, "checkpoint")] == [4, 8]
    assert checkpoint.find(str(run_dir / "checkpoints" / checkpoint.step_dir(4))).step == 4
    assert not events(run_dir, "checkpoint_dropped")
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")] == list(range(8))


@pytest.mark.slow
def test_resizes_keep_the_model_and_track_one_device(ray_wide, tmp_path):
    d = Driver(job(2, 2, steps=STEPS), tmp_path / "run", "resized", out=io.StringIO())
    try:
        d.start()
        out = d.out
        for i, (tp, dp) in enumerate(PHASES):
            if i:
                before = d.logits(FIXED)
                pids = {n: a["pid"] for n, a in ray_actors("raytp.resized.rank").items()}
                kept = set(pids.values())
                outcome = d.resize(tp=tp, dp=dp)
                assert outcome.ok, outcome
                assert "restarting every worker" not in out.getvalue()  # no fallback on one node
                assert (d.layout.tp, d.layout.dp) == (tp, dp)
                after = d.logits(FIXED)
                assert float((after - before).abs().max()) < 1e-5, f"logits moved at {PHASES[i - 1]} -> {tp, dp}"
                names = ray_actors("raytp.resized.rank")
                assert sorted(names) == sorted(f"raytp.resized.rank{r}" for r in range(tp * dp))
                if tp == PHASES[i - 1][0]:  # a DP change keeps the staying workers' processes
                    stay = min(dp, PHASES[i - 1][1]) * tp
                    assert {names[f"raytp.resized.rank{r}"]["pid"] for r in range(stay)} <= kept
                else:  # a TP change keeps replica 0's first min(old, new) ranks' processes (and names)
                    stay = [f"raytp.resized.rank{r}" for r in range(min(tp, PHASES[i - 1][0]))]
                    assert {n: names[n]["pid"] for n in stay} == {n: pids[n] for n in stay}
                    others = {names[f"raytp.resized.rank{r}"]["pid"] for r in range(len(stay), tp * dp)}
                    assert not others & kept, "a rank whose number changed kept its process"
            d.train_loop(until=4 * (i + 1))
    finally:
        d.release()
        d.log.close()
    ours, theirs = np.array(losses(tmp_path / "run")), np.array(one_device_losses(job(1, 1, steps=STEPS)))
    assert len(ours) == STEPS
    rel = np.abs(ours - theirs) / theirs
    assert rel.max() < 1e-4, f"loss curve left one device's by {rel.max():.2e}"
    resized = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl")]
    resized = [e for e in resized if e["kind"] == "resized"]
    assert [(e["old"]["tp"], e["old"]["dp"], e["new"]["tp"], e["new"]["dp"]) for e in resized] == [
        (*PHASES[i], *PHASES[i + 1]) for i in range(len(PHASES) - 1)]
    assert all(e["seconds"] > 0 and e["lost_steps"] == 0 for e in resized)
    shrink = [e["new"]["tp"] == e["old"]["tp"] and e["new"]["dp"] < e["old"]["dp"] for e in resized]
    assert [e["bytes"] > 0 for e in resized] == [not s for s in shrink]  # a DP shrink moves nothing
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(m["tp"], m["dp"]) for m in metrics[::4]] == PHASES


@pytest.mark.slow
def test_the_job_trains_on_while_a_resize_starts_its_new_ranks(ray_wide, tmp_path):
    """A requested TP grow starts its new ranks and returns; the old layout trains on until they are
    up, then the switch pauses training for only its own part."""
    d = Driver(job(2, 1, steps=400), tmp_path / "run", "ahead", out=io.StringIO())
    try:
        d.start()
        d.train_loop(until=2)
        rid = ray.get(d.control.actor.request.remote("scale", tp=4, dp=1))  # what `raytp scale` files
        d.train_loop(until=3)  # served at this step boundary: ranks 2 and 3 start, no answer yet
        assert d.pending_resize is not None and (d.layout.tp, d.layout.dp) == (2, 1)
        assert ray.get(d.control.actor.outcome.remote(rid)) is None
        at_request = d.step - 1
        while d.pending_resize is not None:
            d.train_loop(until=d.step + 1)
        assert (d.layout.tp, d.layout.dp) == (4, 1)
        answer = ray.get(d.control.actor.outcome.remote(rid))
        assert answer["ok"] and answer["layout"] == "TP=4 x DP=1", answer
        trained_meanwhile = d.step - at_request - 1  # the last step ran at the new layout
        assert trained_meanwhile >= 1, "the old layout did not train while the new ranks started"
        metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    finally:
        d.release()
        d.log.close()
    assert [m["tp"] for m in metrics] == [2] * (len(metrics) - 1) + [4]
    (ev,) = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl") if '"resized"' in line]
    assert 0 < ev["stall_s"] < ev["seconds"], ev
