"""Profiling on demand: the job's `profile` section and `raytp profile` write torch.profiler Chrome traces of the
steps asked for, one per rank asked, to the run's checkpoint location, and the driver logs where.

The Ray tests run a real TP=2 job on the shared local Ray (conftest.ray_local); the rest is pure and fast."""
import io
import json
import threading
from pathlib import Path

import pytest
import ray
from click.testing import CliRunner

from faulty import HoldsTheGilInItsExport
from helpers import NEVER_S, close, events, job, raytp_cli, run, run_catching, steps_logged, wait_for
from raytp.cli import main
from raytp.config import ConfigError, from_dict
from raytp.files import checkpoint
from raytp.files.storage import Storage
from raytp.runtime.driver.driver import Driver
from raytp.runtime.driver.profiles import requested_steps
from raytp.runtime.worker.profiling import ProfilePlan, profile_dir, trace_file

JOBS = Path(__file__).resolve().parents[1] / "jobs"


def with_profile(cfg, **section):
    """`cfg` with a profile section."""
    return from_dict({**cfg.to_dict(), "profile": section})


def trace(path) -> dict:
    """A Chrome trace file, checked to hold a step's matrix products; returns it."""
    data = json.loads(path.read_text())
    names = {e.get("name") for e in data["traceEvents"]}
    assert names & {"aten::mm", "aten::addmm"}, sorted(n for n in names if n and n.startswith("aten::"))[:20]
    return data


def step_marks(data) -> set[str]:
    return {e["name"] for e in data["traceEvents"] if e.get("name", "").startswith("raytp step ")}


# -- the job's section and the request, checked before anything starts -----------------------------------
@pytest.mark.parametrize("section, key, says", [
    ({"steps": [3, 1]}, "profile.steps", "needs 0 <= first <= last"),
    ({"steps": [1]}, "profile.steps", "it needs two: [first, last]"),
    ({"steps": [2, 12]}, "profile.steps", "ends past the run's last step, 11"),
    ({"steps": 2}, "profile.steps", "expected a list of integers or null"),
    ({"steps": [1, 2], "ranks": [0, 2]}, "profile.ranks", "names rank 2, but the job has 2 ranks"),
    ({"steps": [1, 2], "ranks": []}, "profile.ranks", "names no rank"),
    ({"steps": [1, 2], "memory": "yes"}, "profile.memory", "expected true or false"),
    ({"step": [1, 2]}, "profile.step", "unknown key (did you mean steps?)"),
])
def test_a_bad_profile_section_is_refused_by_its_key(section, key, says):
    with pytest.raises(ConfigError) as info:
        with_profile(job(tp=2), **section)
    (line,) = info.value.problems
    assert line.startswith(f"<dict>: {key}: ") and says in line, line


def test_a_bad_profile_section_stops_train_before_ray_starts(tmp_path):
    run_dir = tmp_path / "run"
    got = CliRunner().invoke(main, ["train", str(JOBS / "default.yaml"), "--set", "profile.steps=[5, 2]",
                                    "--run-dir", str(run_dir)])
    assert got.exit_code == 2, got.output
    assert "profile.steps: [5, 2]: needs 0 <= first <= last" in got.output
    assert not run_dir.exists()


def test_no_section_and_a_null_one_profile_nothing():
    assert job().profile.steps is None
    assert from_dict({"profile": None}).profile == job().profile
    assert with_profile(job(tp=2), steps=[1, 2], ranks=[1, 0]).to_dict()["profile"] == {
        "steps": [1, 2], "ranks": [1, 0], "memory": False}


def test_a_request_traces_the_next_steps_up_to_the_runs_last():
    assert requested_steps(4, 12, 2, [0, 1], 2, []) == (4, 5)
    assert requested_steps(10, 12, 5, [0], 2, []) == (10, 11)
    assert "no steps left" in requested_steps(12, 12, 1, [0], 2, [])
    assert "valid: 0 to 1" in requested_steps(4, 12, 2, [2], 2, [])
    under_way = [ProfilePlan(5, 6, False, "/x")]
    assert "overlap the profile of steps 5-6" in requested_steps(4, 12, 2, [0], 2, under_way)
    assert requested_steps(7, 12, 2, [0], 2, under_way) == (7, 8)


def test_profiles_live_beside_the_checkpoints_without_being_one(tmp_path):
    """Listing and pruning checkpoints look only at step-<8 digits> folders: a profile folder stays."""
    storage = Storage(tmp_path)
    storage.write_bytes(f"{profile_dir(1, 2)}/{trace_file(0)}", b"{}")
    checkpoint.prune(storage, keep=1)
    assert storage.exists(profile_dir(1, 2), trace_file(0))
    assert checkpoint.list_checkpoints(storage) == []
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.find(str(tmp_path))


# -- on a real Ray ---------------------------------------------------------------------------------------
@pytest.mark.slow  # a job with a checkpoint every two steps: over 10 s (the quick tier runs the request below)
def test_a_profile_of_two_steps_on_two_ranks_lands_in_the_runs_storage(ray_local, tmp_path):
    cfg = with_profile(job(tp=2, steps=6, checkpoint={"every": 2, "keep": 1}), steps=[2, 3], ranks=[0, 1])
    run_dir = tmp_path / "run"
    run(cfg, run_dir, "profiled")
    where = run_dir / "checkpoints" / profile_dir(2, 3)
    for rank in (0, 1):
        data = trace(where / trace_file(rank))
        assert step_marks(data) == {"raytp step 2", "raytp step 3"}  # those steps, and only those
    (ev,) = events(run_dir, "profile")
    assert (ev["steps"], ev["ranks"], ev["where"]) == ([2, 3], [0, 1], str(where))
    assert checkpoint.find(str(run_dir)).step == 6  # pruning kept the profile, listing skipped it


def test_raytp_profile_traces_the_next_steps_of_a_running_job(ray_local, tmp_path):
    """What `raytp profile RUN --steps 2 --ranks 1` files through the control actor, served at the next
    step boundary: answered at once with where, then again once the traces are written. Its two steps run in
    two calls, each on a thread of its own (a profile bound to one thread crashed its export). Its export holds
    the GIL (unanswered pings) for longer than recovery.hang_s: a rank tracing is not taken for hung."""
    d = Driver(job(tp=2, steps=8), tmp_path / "run", "on-demand", out=io.StringIO())
    d.worker_cls = HoldsTheGilInItsExport
    try:
        d.start()
        d.train_loop(until=3)
        actor = d.control.actor
        rid = ray.get(actor.request.remote("profile", steps=2, ranks=[1], memory=True))
        refused = ray.get(actor.request.remote("profile", steps=1, ranks=[2]))
        d.train_loop(until=4)
        taken = ray.get(actor.outcome.remote(rid))
        where = tmp_path / "run" / "checkpoints" / profile_dir(3, 4)
        assert taken == {"ok": True, "step": 3, "steps": [3, 4], "ranks": [1], "where": str(where),
                         "written": False}
        assert "valid: 0 to 1" in ray.get(actor.outcome.remote(refused))["error"]
        d.train_loop()
        done = ray.get(actor.outcome.remote(rid))
    finally:
        close(d)
    assert done["written"] and done["files"] == [str(where / trace_file(1))], done
    assert step_marks(trace(where / trace_file(1))) == {"raytp step 3", "raytp step 4"}
    assert not (where / trace_file(0)).exists()
    (ev,) = events(tmp_path / "run", "profile")
    assert (ev["steps"], ev["ranks"], ev["memory"]) == ([3, 4], [1], True)
    assert events(tmp_path / "run", "failure") == []


@pytest.mark.slow
def test_the_profile_command_asks_a_running_job_and_waits_for_its_traces(ray_local, tmp_path):
    """`raytp profile` from another process, on the cluster the job runs on: the where, then the files."""
    d = Driver(job(tp=2, steps=400), tmp_path / "run", "asked", out=io.StringIO())
    trainer = threading.Thread(target=lambda: run_catching(d), daemon=True)
    trainer.start()
    try:
        wait_for(lambda: steps_logged(tmp_path / "run") >= 2, "the job did not start")
        p = raytp_cli("profile", "asked", "--steps", "2", "--ranks", "0,1", "--timeout", "120",
                      "--address", ray.get_runtime_context().gcs_address)
    finally:
        d.request_stop()
        trainer.join(timeout=NEVER_S)
    (ev,) = events(tmp_path / "run", "profile")
    first, last = ev["steps"]
    where = tmp_path / "run" / "checkpoints" / profile_dir(first, last)
    assert last == first + 1 and ev["ranks"] == [0, 1] and ev["where"] == str(where)
    assert f"traces steps {first}-{last} on rank(s) 0, 1; the traces go to {where}" in p.stdout
    assert f"written: {where / trace_file(0)}, {where / trace_file(1)}" in p.stdout
    for rank in (0, 1):
        assert step_marks(trace(where / trace_file(rank))) == {f"raytp step {first}", f"raytp step {last}"}
