"""The coordinator's decisions and its output buffer, Ray-free (raytp.runtime.coordinator)."""
from raytp.runtime.coordinator.actor import FOLLOWING_S, client_line, orphaned
from raytp.runtime.coordinator.lines import Lines


def test_a_run_is_orphaned_only_past_its_timeout_and_never_when_detached():
    assert not orphaned(last_seen=100.0, now=159.0, timeout_s=60.0, detached=False)
    assert orphaned(last_seen=100.0, now=161.0, timeout_s=60.0, detached=False)
    assert not orphaned(last_seen=100.0, now=10_000.0, timeout_s=60.0, detached=True)


def test_status_names_a_following_client_and_when_a_run_without_one_stops():
    assert client_line(100.0, 100.0 + FOLLOWING_S, 600.0, False) == "following"
    line = client_line(0.0, 50.0, 600.0, False)
    assert line == "none since 00:00:00 UTC; stops with a checkpoint at 00:10:00 UTC unless one attaches"
    assert client_line(0.0, 50.0, 600.0, True) == "none since 00:00:00 UTC (runtime.detached: runs on)"


def test_output_is_read_by_whole_lines_from_a_cursor_and_the_oldest_go_past_the_limit():
    out = Lines(keep=3)
    out.write("a\nb")
    assert out.since(0) == (["a"], 1)  # "b" has no end of line yet
    out.write("\nc\nd\n")
    assert out.since(1) == (["b", "c", "d"], 4)
    assert out.since(0) == (["b", "c", "d"], 4)  # "a" is past the limit: from the oldest kept
    assert out.since(4) == ([], 4) and not out.isatty()


def test_a_run_that_failed_in_its_coordinator_is_raised_as_it_would_be_here():
    import pytest
    from raytp.api.errors import BadJob, RunFailed
    from raytp.api.follow import RemoteError, outcome
    done = {"state": "finished", "steps": 3}
    assert outcome(done, "runs/x") == done
    tb = "Traceback (most recent call last):\n  ...\nKeyError: 'w'\n"
    with pytest.raises(RunFailed) as e:
        outcome({"error": "failed", "exception": ("builtins", "KeyError", "'w'"), "traceback": tb}, "runs/x")
    assert str(e.value) == "KeyError: 'w'" and e.value.run_dir == "runs/x"
    assert isinstance(e.value.__cause__, RemoteError) and tb in e.value.__cause__.__notes__[0]
    with pytest.raises(BadJob, match="^memory: a worker needs 9 GiB$"):
        outcome({"error": "bad", "exception": ("raytp.runtime.errors", "DoesNotFit", "memory: a worker needs 9 GiB"),
                 "traceback": tb}, "runs/x")


def test_the_coordinator_is_given_the_clients_tracker_and_storage_variables_only():
    from raytp.runtime.coordinator.actor import forwarded_env
    env = {"WANDB_API_KEY": "k", "WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": "file:/m", "AWS_ACCESS_KEY_ID": "a",
           "HF_TOKEN": "t", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0", "RAY_ADDRESS": "h:6379", "HOME": "/root"}
    assert forwarded_env(env) == {"WANDB_API_KEY": "k", "WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": "file:/m",
                                  "AWS_ACCESS_KEY_ID": "a", "HF_TOKEN": "t"}
