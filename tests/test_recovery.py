"""Fault recovery: kill workers from outside (as reality does) and the job finishes with the very
weights of an uninterrupted run."""
import json
import os
import re
import signal
import threading
from pathlib import Path

import pytest
import ray

from helpers import (NEVER_S, RECOVERY_STEPS, assert_bitwise_equal, events, final_state, ray_actors, recovery_job,
                     run, run_catching, signal_rank, steps_logged, wait_for)
from raytp.runtime.driver.driver import Driver
from raytp.runtime.errors import JobError, RecoveryFailed
from raytp.files import checkpoint

STEPS = RECOVERY_STEPS


@pytest.fixture(scope="module")
def reference(ray_local, recovery_reference):
    """reference(tp, dp): the final state of an uninterrupted run at that layout (conftest's, shared with
    test_node_loss), run when a test first asks for it (a test run alone runs only its own)."""
    return recovery_reference


@pytest.mark.slow
def test_a_rank_gone_with_its_sockets_left_open_is_healed_without_waiting_out_the_collective(reference, tmp_path):
    """Rank 3 leaves in its step's last collective, but its sockets stay open (a child holds them), as those of a
    host that froze or left the network do: its peers, blocked on it, are not left to the collective timeout
    (120 s): their collectives are aborted, and the run ends as the unbroken one."""
    import faulty
    marker = str(tmp_path / "left")
    faulty.LeavesItsSocketsOpen.at, faulty.LeavesItsSocketsOpen.marker = {3: 6}, marker
    run_dir = tmp_path / "run"
    with faulty.SocketHolder(f"{marker}.sock") as holder:  # holds them open until the run has ended
        run(recovery_job(2, 2, step_timeout_s=NEVER_S), run_dir, "open", worker_cls=faulty.LeavesItsSocketsOpen)
        assert holder.fds, "rank 3 handed over no socket"
    assert_bitwise_equal(final_state(run_dir), reference(2, 2))
    out = (tmp_path / "open.out").read_text()
    assert "their collectives were aborted" in out and re.search(r"sockets shut: rank \d+: [1-9]", out), out[-2000:]
    assert [e["rank"] for e in events(run_dir, "failure")] == [3]
    assert [m["step"] for m in map(json.loads, open(run_dir / "metrics.jsonl"))] == list(range(STEPS))


@pytest.mark.slow
def test_a_rank_no_abort_gets_out_is_recorded_where_it_was_ended_and_replaced(reference, tmp_path):
    """TP=1 x DP=2: rank 1 leaves in its step's last collective with its sockets held open, and no abort gets rank
    0 out. STACKS_AFTER_S after the abort the recovery records where rank 0's threads were (`still_blocked`: its
    step thread in that collective) and that its process was idle since: blocked for good, it is ended and
    replaced as a lost rank, not waited out for runtime.collective_timeout_s (120 s, the default). With no live
    holder left, the state comes from the snapshot; the run ends as the unbroken one."""
    import faulty
    from raytp.runtime.leaving import ABORT_AFTER_S, IDLE_CPU_SHARE, STACKS_AFTER_S
    marker = str(tmp_path / "left")
    faulty.AbortsNothing.at, faulty.AbortsNothing.marker = {1: 6}, marker
    run_dir = tmp_path / "run"
    with faulty.SocketHolder(f"{marker}.sock") as holder:
        run(recovery_job(1, 2, step_timeout_s=NEVER_S, collective_timeout_s=120.0), run_dir, "noabort",
            worker_cls=faulty.AbortsNothing)
        assert holder.fds, "rank 1 handed over no socket"
    assert_bitwise_equal(final_state(run_dir), reference(1, 2))
    assert [m["step"] for m in map(json.loads, open(run_dir / "metrics.jsonl"))] == list(range(STEPS))
    (ev,) = events(run_dir, "still_blocked")
    assert ev["ranks"] == [0] and ev["after_s"] == ABORT_AFTER_S + STACKS_AFTER_S, ev
    assert ev["ended"] == [0] and ev["cpu_share"]["0"] < IDLE_CPU_SHARE, ev
    step_thread = ev["stacks"]["0"]["raytp-rank0-steps"]
    assert "all_gather" in step_thread and "_step" in step_thread, step_thread
    assert sorted((e["rank"], e["cause"]) for e in events(run_dir, "failure")) == [(0, "stuck"), (1, "died")]
    out = (tmp_path / "noabort.out").read_text()
    assert "[0] ended and replaced as lost ranks (blocked for good)" in out and "(sockets shut: rank 0: 0)" in out, \
        out[-2000:]
    (rec,) = events(run_dir, "recovered")
    assert rec["source"] == "snapshot" and rec["seconds"] < 60, rec  # not the 120 s collective timeout


@pytest.mark.slow
def test_a_replacement_lost_while_the_ranks_meet_leaves_the_survivors_their_processes(reference, tmp_path):
    """Rank 1 is SIGKILLed; its replacement exits as its setup begins, while the survivors wait for it in the
    rendezvous: they are got out (not held runtime.collective_timeout_s, 120 s) and keep their processes and
    state; a second replacement takes rank 1, and the run ends as the unbroken one, every step's record once."""
    import faulty
    faulty.ReplacementDiesInSetup.rank_of, faulty.ReplacementDiesInSetup.marker = 1, str(tmp_path / "m")
    run_dir = tmp_path / "run"
    run(recovery_job(2, 2, step_timeout_s=NEVER_S), run_dir, "meet", faults=[(4, signal_rank(1, signal.SIGKILL))],
        worker_cls=faulty.ReplacementDiesInSetup)
    assert_bitwise_equal(final_state(run_dir), reference(2, 2))
    assert [m["step"] for m in map(json.loads, open(run_dir / "metrics.jsonl"))] == list(range(STEPS))
    pids = [{r["rank"]: r["pid"] for r in e["ranks"]} for e in events(run_dir, "placed")]
    assert all(pids[-1][r] == pids[0][r] for r in (0, 2, 3)), pids  # the survivors' processes, all along
    assert len({p[1] for p in pids}) == 2 and (tmp_path / "m-setup-2").exists()  # the second replacement
    assert "rank(s) [1] start anew, the others keep their state" in (tmp_path / "meet.out").read_text()


# A SIGKILL of a random rank at TP=2 x DP=2, healed from the replica bit for bit with every step's record once, is
# tests/test_random_faults.py's (with kills inside recoveries, hangs, zero 1, PP and EP).
@pytest.mark.slow
def test_a_warm_spare_takes_the_place_of_a_killed_worker(reference, tmp_path):
    run_dir = tmp_path / "run"
    seen = {}

    def kill_rank_1_once_the_spare_is_up(run_name):
        wait_for(lambda: [e for e in events(run_dir, "spares") if "ready" in e], "the spare was not reported ready")
        seen.update(ray_actors(f"raytp.{run_name}.spare"))
        signal_rank(1, signal.SIGKILL)(run_name)

    from faulty import HOLD_S, WaitsForSpare
    WaitsForSpare.spare = "raytp.spare.spare0"  # the job waits for it, so it is up before the job ends
    run(recovery_job(2, 1, recovery={"spares": 1}, step_timeout_s=2 * HOLD_S), run_dir, "spare",
        faults=[(3, kill_rank_1_once_the_spare_is_up)], worker_cls=WaitsForSpare)
    assert_bitwise_equal(final_state(run_dir), reference(2, 1))
    (rec,) = events(run_dir, "recovered")
    assert rec["spares"] == ["raytp.spare.spare0"] and rec["source"] == "snapshot" and rec["lost_steps"] <= 1
    placed = events(run_dir, "placed")[-1]["ranks"]
    assert placed[1]["pid"] == seen["raytp.spare.spare0"]["pid"], "rank 1 is not the spare's process"
    assert placed[1]["actor"] == "raytp.spare.spare0"  # what `raytp status --ranks` shows for rank 1
    # Ray cannot rename an actor: the spare tells Ray's log monitor its new role, so its log lines (as the
    # dashboard and `ray logs` show them) carry its rank.
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    out = [f for f in logs.glob(f"worker-*-{placed[1]['pid']}.out")]
    assert out and ":actor_name:Worker(rank 1, TP rank 1/2, DP rank 0/1)" in out[0].read_text(), out
    started = [s for e in events(run_dir, "spares") for s in e.get("started", [])]
    assert [s["name"] for s in started] == ["raytp.spare.spare0", "raytp.spare.spare1"]
    (replica0,) = [g for g, t in ray.util.placement_group_table().items()
                   if t["name"].startswith("raytp.spare.replica0.")]
    assert started[0]["group"] != replica0 and (started[1]["group"], started[1]["bundle"]) == (replica0, 1), \
        "the new spare starts in the bundle rank 1 left"
    assert not ray_actors("raytp.spare."), "actors left after the run"


@pytest.mark.slow
def test_failure_during_a_checkpoint_save_then_a_hung_worker(reference, tmp_path):
    """TP=2 x DP=2, two faults in one run, each restored from the DP replica: rank 1 dies inside the save of
    step 8 (the job heals, saves step 8 again and goes on); then rank 1's new process is SIGSTOPped after
    step 10, and the heartbeat finds it (the step deadline, 30 s, is the last resort)."""
    from faulty import DiesInSave
    DiesInSave.marker = str(tmp_path / "died-once")
    run_dir = tmp_path / "run"
    cfg = recovery_job(2, 2, recovery={"ping_timeout_s": 2.0})
    cfg = cfg.__class__(**{**cfg.__dict__, "checkpoint": cfg.checkpoint.__class__(every=8, keep=3)})
    run(cfg, run_dir, "insave", faults=[(10, signal_rank(1, signal.SIGSTOP))], worker_cls=DiesInSave)
    assert os.path.exists(DiesInSave.marker), "the fault was not injected"
    assert_bitwise_equal(final_state(run_dir), reference(2, 2))
    assert [e["step"] for e in events(run_dir, "checkpoint")] == [8, 16]
    assert checkpoint.find(str(run_dir / "checkpoints" / "step-00000008")).step == 8
    fails, recs = events(run_dir, "failure"), events(run_dir, "recovered")
    assert [f["rank"] for f in fails] == [1, 1] and fails[1]["cause"] == "hung", fails
    assert [r["source"] for r in recs] == ["replica", "replica"] and recs[1]["lost_steps"] == 0, recs


@pytest.mark.slow
def test_too_many_failures_fail_clearly_and_leave_a_checkpoint(ray_local, tmp_path):
    run_dir = tmp_path / "run"
    cfg = recovery_job(2, 1, recovery={"max_failures": 0})
    d = Driver(cfg, run_dir, "giveup", out=open(tmp_path / "out", "w"))
    holder = []
    t = threading.Thread(target=lambda: holder.append(run_catching(d)), daemon=True)
    t.start()
    wait_for(lambda: steps_logged(run_dir) >= 5 or not t.is_alive(), "the job did not take 5 steps")
    signal_rank(1, signal.SIGKILL)("giveup")
    t.join(timeout=NEVER_S)
    (err,) = holder
    assert isinstance(err, RecoveryFailed)
    assert "1 worker losses exceed recovery.max_failures=0" in str(err)
    assert "saved the newest snapshot as" in str(err)
    assert checkpoint.find(str(run_dir)).step >= 5
    assert not ray_actors("raytp.giveup.")


@pytest.mark.slow  # over 15 s: the quick tier keeps under 3 minutes
def test_an_error_of_the_job_itself_fails_it_at_once(ray_local, tmp_path):
    """Every worker alive, a step raising: no recovery (it would only repeat), a clear failure."""
    from faulty import Buggy
    # A step deadline far past the test's timeout: the failure cannot come from it, only from the error.
    d = Driver(recovery_job(2, 1, step_timeout_s=3600.0), tmp_path / "run", "buggy", out=open(tmp_path / "out", "w"))
    d.worker_cls = Buggy
    with pytest.raises(JobError, match="a step failed with every worker alive.*a bug in the training code"):
        d.run_to_end()
    assert [e["kind"] for e in events(tmp_path / "run") if e["kind"] in ("failure", "recovered", "failed")] == ["failed"]
    assert d.failures == 0 and not ray_actors("raytp.buggy.")
