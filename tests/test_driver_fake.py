"""The driver's loop, recovery and resize carried out on a fake worker group (tests/fakes.py), without
Ray: each decision path in milliseconds, beside the real-cluster tests of the same paths."""
import dataclasses
import io
import json
import time

import pytest

from fake_driver_parts import LocalControl, NoCopy
from fake_state import NAME, expected_x
from fakes import FakeCluster
from helpers import events, job
from raytp.runtime.driver.driver import Driver
from raytp.runtime.errors import JobError, RecoveryFailed
from raytp.files import checkpoint

STEPS = 12


def fake_driver(cluster, cfg, run_dir, name="fake"):
    class FakeDriver(Driver):
        group_cls = cluster.group_class()
        control_cls = LocalControl
        copy_cls = NoCopy
    return FakeDriver(cfg, run_dir, name, out=io.StringIO(), ray_metrics=False)


def fake_job(tp, dp, recovery=None, min_dp=None, **kw):
    cfg = job(tp, dp, steps=STEPS, checkpoint={"every": STEPS}, recovery=recovery, **kw)
    if min_dp is not None:
        cfg = cfg.__class__(**{**cfg.__dict__, "parallel": cfg.parallel.__class__(tp=tp, dp=dp, min_dp=min_dp)})
    return cfg


def x_saved(run_dir, step=STEPS):
    return checkpoint.find(str(run_dir / "checkpoints" / checkpoint.step_dir(step))).read(f"model/{NAME}", 0, 1).item()


def metric_steps(run_dir):
    return [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]


def test_an_uninterrupted_run(tmp_path):
    d = fake_driver(FakeCluster(slots=4), fake_job(2, 2), tmp_path)
    assert d.run_to_end()["state"] == "finished"
    assert x_saved(tmp_path) == expected_x(STEPS)
    assert metric_steps(tmp_path) == list(range(STEPS))
    assert [e["kind"] for e in events(tmp_path)] == ["started", "placed", "survival", "first_step", "checkpoint", "finished"]


def test_a_lost_rank_is_restored_from_its_dp_replica(tmp_path):
    cluster = FakeCluster(slots=4)
    cluster.kill_at(5, 3)
    fake_driver(cluster, fake_job(2, 2), tmp_path).run_to_end()
    assert x_saved(tmp_path) == expected_x(STEPS)
    (fail,), (rec,) = events(tmp_path, "failure"), events(tmp_path, "recovered")
    assert (fail["rank"], fail["step"]) == (3, 5)
    assert (rec["source"], rec["lost_steps"], rec["ranks"]) == ("replica", 0, [3])
    assert metric_steps(tmp_path) == list(range(STEPS))


@pytest.mark.parametrize("every, lost", [(1, 0), (2, 1)])
def test_without_a_replica_everyone_rolls_back_to_the_snapshot(tmp_path, every, lost):
    cluster = FakeCluster(slots=2)
    cluster.kill_at(5, 1)  # survivors completed 5 steps; snapshots after 4 (every 2) or 5 (every 1)
    fake_driver(cluster, fake_job(2, 1, recovery={"snapshot_every": every}), tmp_path).run_to_end()
    assert x_saved(tmp_path) == expected_x(STEPS), "the replay did not restart from the right state"
    (rec,) = events(tmp_path, "recovered")
    assert (rec["source"], rec["lost_steps"]) == ("snapshot", lost)
    assert metric_steps(tmp_path) == list(range(STEPS)), "one metrics line per step, none twice"


def test_no_capacity_shrinks_an_elastic_job_and_it_grows_back(tmp_path):
    cluster = FakeCluster(slots=4)
    cluster.kill_at(5, 2, 3, slots=2)  # replica 1's node goes
    cluster.give_at(8, 2)
    fake_driver(cluster, fake_job(2, 2, min_dp=1), tmp_path).run_to_end()
    assert x_saved(tmp_path) == expected_x(STEPS)
    resized = events(tmp_path, "resized")
    assert [(e["old"]["dp"], e["new"]["dp"]) for e in resized] == [(2, 1), (1, 2)]
    assert resized[0]["reason"].startswith("lost capacity") and resized[1]["reason"] == "capacity returned"
    (rec,) = events(tmp_path, "recovered")
    assert rec["source"] == "shrink to DP=1"
    assert metric_steps(tmp_path) == list(range(STEPS))
    assert [len(a) for a in cluster.asked] == [4, 0]  # the autoscaler asked for TP=2 x DP=2, then not


def test_a_shrink_keeps_the_replica_of_a_survivor_ended_as_blocked_for_good(tmp_path):
    """Replica 1's node goes and rank 0 stays blocked in the failed step (ended as blocked for good): its
    replacement comes up in its own bundle, so replica 0 is kept, rank 0 taking its state anew (from the snapshot:
    no live rank holds its TP shard); every step's record once, the end as the unbroken run's."""
    cluster = FakeCluster(slots=4)
    cluster.kill_at(5, 2, 3, slots=2)
    cluster.blocked = {0}
    fake_driver(cluster, fake_job(2, 2, min_dp=1), tmp_path).run_to_end()
    assert x_saved(tmp_path) == expected_x(STEPS)
    (resized,) = events(tmp_path, "resized")
    assert (resized["old"]["dp"], resized["new"]["dp"]) == (2, 1)
    assert sorted((e["rank"], e["cause"]) for e in events(tmp_path, "failure")) == [(0, "stuck"), (2, "died"),
                                                                                   (3, "died")]
    (rec,) = events(tmp_path, "recovered")
    assert rec["source"].startswith("shrink to DP=1"), rec
    assert metric_steps(tmp_path) == list(range(STEPS))


def test_no_capacity_and_not_elastic_fails_with_a_checkpoint_of_the_newest_snapshot(tmp_path):
    cluster = FakeCluster(slots=2)
    cluster.kill_at(5, 1, slots=2)
    d = fake_driver(cluster, fake_job(2, 1), tmp_path)
    with pytest.raises(RecoveryFailed, match=r"no capacity to replace rank\(s\) \[1\].*saved the newest snapshot"):
        d.run_to_end()
    assert x_saved(tmp_path, 5) == expected_x(5)
    assert events(tmp_path)[-1]["kind"] == "failed"
    assert all(not w.alive for w in d.group.workers) and not cluster.pgs, "actors or groups left behind"


def test_too_many_failures_give_up_and_an_error_of_the_job_fails_at_once(tmp_path):
    cluster = FakeCluster(slots=2)
    cluster.kill_at(5, 1)
    with pytest.raises(RecoveryFailed, match="1 worker losses exceed recovery.max_failures=0"):
        fake_driver(cluster, fake_job(2, 1, recovery={"max_failures": 0}), tmp_path / "a").run_to_end()
    cluster = FakeCluster(slots=2)
    cluster.failing_steps.add(3)
    d = fake_driver(cluster, fake_job(2, 1), tmp_path / "b")
    with pytest.raises(JobError, match="a step failed with every worker alive"):
        d.run_to_end()
    assert d.failures == 0 and not events(tmp_path / "b", "failure")


def test_a_scale_request_trains_on_while_the_new_ranks_start_then_switches(tmp_path):
    cluster = FakeCluster(slots=6, start_calls=2)  # a new process takes two step calls to come up
    d = fake_driver(cluster, fake_job(2, 1), tmp_path)
    try:
        d.start()
        d.train_loop(until=2)
        bad = d.control.file("scale", tp=3, dp=1)
        rid = d.control.file("scale", tp=4, dp=1)
        d.train_loop(until=3)  # served at this boundary: ranks 2 and 3 start, no answer yet
        assert "valid tp: 1, 2, 4" in d.control.outcomes[bad]["error"]
        assert d.pending_resize is not None and rid not in d.control.outcomes
        while d.pending_resize is not None:
            d.train_loop(until=d.step + 1)
        assert (d.layout.tp, d.layout.dp) == (4, 1) and d.control.outcomes[rid]["ok"]
        assert d.step >= 4, "the old layout did not train while the new ranks started"
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    assert x_saved(tmp_path) == expected_x(STEPS)
    (ev,) = events(tmp_path, "resized")
    assert (ev["old"], ev["new"]) == ({"tp": 2, "pp": 1, "dp": 1}, {"tp": 4, "pp": 1, "dp": 1}) and 0 <= ev["stall_s"] < ev["seconds"]
    assert 0 < ev["switch_s"] < ev["seconds"]  # the pause as metrics.jsonl shows it is ~0 in the fake; the switch is not
    assert not cluster.pgs, "placement groups left after release"


def test_a_stop_request_saves_and_answers(tmp_path):
    d = fake_driver(FakeCluster(slots=2), fake_job(2, 1), tmp_path)
    try:
        d.start()
        d.train_loop(until=3)
        ctl = d.control
        rid = ctl.file("stop")
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    answer = ctl.outcomes[rid]
    assert answer["ok"] and answer["step"] == 3 and answer["checkpoint"].endswith("step-00000003")
    assert events(tmp_path, "stopped")[0]["step"] == 3 and x_saved(tmp_path, 3) == expected_x(3)


def test_snapshots_are_taken_as_often_as_their_budget_allows(tmp_path):
    """A snapshot costing 0.3 ms against 1 ms steps and the default 3% budget: one every 10 steps, the
    interval (and the lost-steps bound it implies) logged; a failure then replays from the last one."""
    cluster = FakeCluster(slots=2)
    cluster.snapshot_s = 0.0003
    cluster.kill_at(15, 1)
    cfg = job(2, 1, steps=24, checkpoint={"every": 24})
    fake_driver(cluster, cfg, tmp_path).run_to_end()
    (ev,) = events(tmp_path, "snapshot_interval")
    assert (ev["every"], ev["lost_steps_bound"], ev["budget"]) == (10, 10, 0.03)
    (rec,) = events(tmp_path, "recovered")
    assert rec["source"] == "snapshot" and 0 < rec["lost_steps"] <= 10
    assert x_saved(tmp_path, 24) == expected_x(24)


def test_lifting_a_snapshot_pin_resumes_the_measured_interval():
    """The interval chosen from measurements is kept while a pin (here 0, off) is in force, so a job whose
    pin is lifted snapshots at it at once rather than not at all."""
    import dataclasses
    from raytp.parallel.layout import Layout
    from raytp.runtime.state.snapshots import Cadence
    cfg = job(2, 1, steps=24)
    pinned = dataclasses.replace(cfg, recovery=dataclasses.replace(cfg.recovery, snapshot_every=0))
    free = dataclasses.replace(cfg, recovery=dataclasses.replace(cfg.recovery, snapshot_every=None))
    c = Cadence(free)
    for _ in range(3):
        c.observe({"step_time_s": 0.001, "snapshot_s": 0.0003})
    assert c.choose(free, Layout(2, dp=1), ["n", "n"]) == 10
    assert c.choose(pinned, Layout(2, dp=1), ["n", "n"]) == 0 and c.every == 0
    c.follow(free)
    assert c.every == 10


def test_a_snapshot_that_slows_the_step_it_overlaps_costs_that_slowdown():
    """On busy cores a snapshot's packing slows the step it overlaps by more than its own measured time:
    measured alone (3 ms against 100 ms steps, the 3% budget) one every step would fit; the steps that
    carry one are 9 ms slower, so one every 3."""
    from raytp.parallel.layout import Layout
    from raytp.runtime.state.snapshots import Cadence
    cfg = job(2, 1, steps=24)
    c = Cadence(cfg)
    c.observe({"step": 0, "step_time_s": 0.1, "snapshot_s": 0.003})
    assert c.choose(cfg, Layout(2, dp=1), ["n", "n"]) is None and c.every == 1  # 3 ms = 3% of 100 ms
    c.pinned = None
    c.chosen = 2  # as if chosen before: steps 2, 4, ... carry a snapshot
    for step in range(1, 9):
        c.observe({"step": step, "step_time_s": 0.109 if step % 2 == 0 else 0.1, "snapshot_s": 0.003})
    assert abs(c.cost() - 0.009) < 1e-9
    assert c.choose(cfg, Layout(2, dp=1), ["n", "n"]) == 3 and c.every == 3


def planned_calls(steps, steps_per_call, eval_every, save_every):
    """(start, count) of each call the driver makes without pipelining: raytp.runtime.policy's plan."""
    from raytp.runtime import policy
    out, step = [], 0
    while step < steps:
        n = policy.call_length(step, steps, steps_per_call, bool(out), eval_every, save_every)
        out.append((step, n))
        step += n
    return out


def test_calls_submitted_behind_the_running_one_change_nothing(tmp_path):
    """The next call is submitted while the current one runs wherever nothing happens between them (no
    evaluation, checkpoint or request): the same calls as the plan, the same state at the end."""
    cluster = FakeCluster(slots=4)
    fake_driver(cluster, fake_job(2, 2), tmp_path).run_to_end()
    assert [c[:2] for c in cluster.calls] == planned_calls(STEPS, 4, 6, STEPS)
    behind = {c[0] for c in cluster.calls if c[2]}
    assert behind == {1, 5, 10}, "6 follows an evaluation: submitted after it"
    assert x_saved(tmp_path) == expected_x(STEPS) and metric_steps(tmp_path) == list(range(STEPS))


def test_a_failure_fails_the_call_behind_and_recovers_at_the_right_step(tmp_path):
    """A rank dies in step 3, inside the call 1..4 with 5 submitted behind it: that call never runs (the
    workers refuse it: the call before failed), the rank is restored from its replica at step 3, training goes on from there, and the run ends at the
    state of an uninterrupted one."""
    cluster = FakeCluster(slots=4)
    cluster.kill_at(3, 1)
    fake_driver(cluster, fake_job(2, 2), tmp_path).run_to_end()
    assert cluster.calls[:3] == [(0, 1, False), (1, 4, True), (3, 3, False)]
    assert all(start != 5 for start, _, _ in cluster.calls)
    (fail,), (rec,) = events(tmp_path, "failure"), events(tmp_path, "recovered")
    assert (fail["step"], rec["source"], rec["lost_steps"]) == (3, "replica", 0)
    assert x_saved(tmp_path) == expected_x(STEPS) and metric_steps(tmp_path) == list(range(STEPS))


def test_a_request_filed_while_a_call_runs_behind_another_is_served_after_it(tmp_path):
    """`raytp stop` filed during step 2 (call 1..4; call 5 was submitted behind it before): the stop
    lands at step 6, after the call already submitted, with a checkpoint of that step."""
    cluster = FakeCluster(slots=2)
    d = fake_driver(cluster, fake_job(2, 1), tmp_path)
    filed = []
    cluster.during[2] = lambda: filed.append((d.control, d.control.file("stop")))
    d.run_to_end()
    assert cluster.calls == [(0, 1, False), (1, 4, True), (5, 1, True)]
    (ctl, rid), = filed
    assert ctl.outcomes[rid]["step"] == 6 and events(tmp_path, "stopped")[0]["step"] == 6
    assert x_saved(tmp_path, 6) == expected_x(6)


def test_follow_on_only_where_the_boundary_needs_nothing():
    from raytp.runtime.driver.follow_on import follow_on
    assert follow_on(1, 12, 12, 4, 6, 12, None, quiet=True) == 4
    assert follow_on(1, 12, 12, 4, 6, 12, None, quiet=False) is None   # a request or resize waits
    assert follow_on(6, 12, 12, 4, 6, 12, None, quiet=True) is None    # an evaluation at 6
    assert follow_on(4, 12, 12, 4, 0, 4, None, quiet=True) is None     # a checkpoint begins at 4
    assert follow_on(4, 12, 12, 4, 0, 4, 4, quiet=True) == 4           # ... unless saved already
    assert follow_on(3, 3, 12, 4, 0, 0, None, quiet=True) is None      # the loop ends at 3


def test_status_is_published_when_it_changes_and_the_ranks_when_placed(tmp_path):
    d = fake_driver(FakeCluster(slots=4), fake_job(2, 2), tmp_path)
    try:
        d.start()
        ctl = d.control
        d.publish()  # the state is "running" now
        n = ctl.published
        d.publish()
        assert ctl.published == n, "nothing changed: nothing published"
        assert [r["rank"] for r in ctl.status["ranks"]] == [0, 1, 2, 3]
        d.train_loop(until=1)
        assert ctl.published > n and ctl.status["step"] == 1 and len(ctl.status["ranks"]) == 4
    finally:
        d.release()
        d.log.close()


def test_a_scale_request_with_no_room_waits_for_it_while_the_job_trains_on(tmp_path):
    """TP=2 x DP=1 fills the cluster; DP=2 is asked for: no room beside the job, none inside its bundles. The
    request is not refused nor waited for on the loop: the job trains on, looks again at each boundary, and
    grows once capacity comes (before step 6); every step keeps its record."""
    cluster = FakeCluster(slots=2)
    cluster.give_at(6, 2)
    d = fake_driver(cluster, fake_job(2, 1), tmp_path)
    try:
        d.start()
        d.train_loop(until=2)
        rid = d.control.file("scale", tp=2, dp=2)
        d.train_loop(until=3)
        assert d.changes.elastic.awaiting is not None and rid not in d.control.outcomes
        while rid not in d.control.outcomes and d.step < STEPS:
            d.train_loop(until=d.step + 1)
        assert d.control.outcomes[rid]["ok"] and (d.layout.tp, d.layout.dp) == (2, 2)
        assert d.step >= 6, "the job did not train on while it waited for room"
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    assert x_saved(tmp_path) == expected_x(STEPS)
    assert metric_steps(tmp_path) == list(range(STEPS))
    assert not events(tmp_path, "resize_refused")


def test_a_scale_request_whose_room_never_comes_is_refused_after_the_placement_timeout(tmp_path):
    cluster = FakeCluster(slots=2)
    cfg = fake_job(2, 1)
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, placement_timeout_s=0.05))
    d = fake_driver(cluster, cfg, tmp_path)
    try:
        d.start()
        d.train_loop(until=2)
        rid = d.control.file("scale", tp=2, dp=2)
        while rid not in d.control.outcomes and d.step < STEPS:
            time.sleep(0.03)  # fake steps take no time: let the timeout pass within a few of them
            d.train_loop(until=d.step + 1)
        assert "could not place the workers within 0.05s: no room for" in d.control.outcomes[rid]["error"]
        assert (d.layout.tp, d.layout.dp) == (2, 1)
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    assert metric_steps(tmp_path) == list(range(STEPS))
    (ev,) = events(tmp_path, "resize_refused")
    assert ev["new"]["dp"] == 2
