"""`raytp submit/status/logs/stop/scale` against a real Ray head, as a user drives them (conftest's `head`, one
per module: tests/ray_head.py). Every command runs as a fresh `python -m raytp.cli` process."""
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from ray_head import ROOT, SMALL, _answers, _free_port, alive_actors, leftovers, raytp, wait_for


@pytest.mark.parametrize("env, why", [
    ('[1, 2]', "must be a mapping"), ('{"working_dir": "."}', "working_dir is raytp's"),
    ('{"env_vars": {"N": 1}}', "must be strings"), ("{not json", "neither a readable"),
])
def test_a_bad_runtime_env_says_what_is_wrong(env, why):
    from raytp.jobs import read_runtime_env
    with pytest.raises(ValueError, match=why):
        read_runtime_env(env)


def test_a_runtime_env_file_is_read_and_merged_beside_raytps_own(tmp_path):
    from raytp.jobs import make_submission, read_runtime_env
    (tmp_path / "env.yaml").write_text("env_vars: {NCCL_DEBUG: INFO}\npip: [einops]\npy_modules: [/opt/mine]\n")
    (tmp_path / "job.yaml").write_text("name: j\n")
    (tmp_path / "stage").mkdir()
    sub = make_submission(tmp_path / "job.yaml", (), "r", None, 60, tmp_path / "stage", None,
                          read_runtime_env(str(tmp_path / "env.yaml")))
    env = sub.runtime_env
    assert env["env_vars"] == {"RAY_JOB_STOP_WAIT_TIME_S": "60", "NCCL_DEBUG": "INFO"} and env["pip"] == ["einops"]
    assert env["py_modules"][1:] == ["/opt/mine"] and env["py_modules"][0].endswith("raytp")
    assert env["working_dir"] == str(tmp_path / "stage")


def test_a_bad_runtime_env_is_refused_before_the_cluster_is_asked():
    p = raytp("submit", "jobs/default.yaml", "--address", "http://127.0.0.1:9", "--runtime-env", '{"working_dir": 1}')
    assert p.returncode == 2 and "error: --runtime-env: working_dir is raytp's" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


@pytest.mark.slow  # every test given the head is: it starts a real head (and runs jobs on it)
def test_submitted_run_runs_to_success_with_status_and_logs(head, tmp_path):
    run_dir = tmp_path / "short"
    p = raytp("submit", "jobs/default.yaml", "--address", head.dashboard, "--name", "short", "--run-dir",
              str(run_dir), "--set", "train.steps=30", *SMALL,
              "--runtime-env", '{"env_vars": {"RAYTP_PROBE": "every worker sees it"}}')
    assert p.returncode == 0, p.stderr[-3000:]
    assert "submitted run short as Ray job raytp-short" in p.stdout
    assert "raytp status short" in p.stdout and "raytp logs short --follow" in p.stdout
    seen = raytp("status", "short", "--address", head.dashboard)
    assert seen.returncode == 0, seen.stderr[-2000:]
    assert re.search(r"Ray job raytp-short: (PENDING|RUNNING)", seen.stdout), seen.stdout
    # Every worker process has the env var the submission's --runtime-env set (read while they run).
    placed = wait_for("workers placed", lambda: (run_dir / "events.jsonl").exists() and [
        json.loads(line) for line in open(run_dir / "events.jsonl") if '"placed"' in line], every=0.05)
    for worker in placed[0]["ranks"]:
        environ = Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
        assert b"RAYTP_PROBE=every worker sees it" in environ, f"rank {worker['rank']} lacks the env var"

    # A second run of the same name is refused, and nothing replaces the first.
    again = raytp("submit", "jobs/default.yaml", "--address", head.dashboard, "--name", "short")
    assert again.returncode == 1 and "already submitted" in again.stderr

    follow = raytp("logs", "short", "--follow", "--address", head.dashboard)
    assert follow.returncode == 0, follow.stderr[-2000:]
    assert "[raytp] step 1/30" in follow.stdout and "[raytp] step 30/30" in follow.stdout
    assert "[raytp] finished 30 steps" in follow.stdout

    done = wait_for("SUCCEEDED", lambda: (s := raytp("status", "short", "--address", head.dashboard))
                    and "SUCCEEDED" in s.stdout and s, every=2)
    assert "short: SUCCEEDED  step 30/30" in done.stdout
    assert "Ray job raytp-short: SUCCEEDED" in done.stdout
    by_gcs = raytp("status", "short", "--address", head.gcs)  # the other door gives the same answer
    assert by_gcs.returncode == 0 and "short: SUCCEEDED  step 30/30" in by_gcs.stdout, by_gcs.stderr[-2000:]
    assert "short: SUCCEEDED" in raytp("status", "--address", head.dashboard).stdout

    logs = raytp("logs", "short", "--address", head.dashboard)
    assert logs.returncode == 0 and "[raytp] step 30/30" in logs.stdout
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 30  # the head is this machine


@pytest.fixture(scope="module")
def prometheus(head, tmp_path_factory):
    """A real Prometheus (Debian's package; .ci/run installs it) scraping the head's metrics endpoint every
    second, on loopback. Yields a function: PromQL -> the result list of an instant query."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    d = tmp_path_factory.mktemp("prometheus")
    (d / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: ray, static_configs: [{{targets: ['127.0.0.1:{head.metrics_port}']}}]}}]\n")
    port = _free_port()
    proc = subprocess.Popen([binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(d / "log", "w"))

    def query(expr: str) -> list:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return json.loads(urllib.request.urlopen(url, timeout=10).read())["data"]["result"]
    try:
        wait_for("prometheus", lambda: proc.poll() is not None or _answers(port))
        assert proc.poll() is None, (d / "log").read_text()[-2000:]
        yield query
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_long_run_exports_metrics_scales_and_stops_cleanly(head, prometheus, tmp_path):
    run_dir = tmp_path / "long"
    p = raytp("submit", "jobs/default.yaml", "--address", head.dashboard, "--name", "long", "--run-dir",
              str(run_dir), "--set", "train.steps=100000", "--set", "checkpoint.every=0",
              "--set", "train.steps_per_call=5", *SMALL, "--set", "train.eval_interval=5",
              "--set", "runtime.peak_tflops=1")  # a CPU has no peak in raytp's table: MFU is reported with one
    assert p.returncode == 0, p.stderr[-3000:]

    # Its first step in the run dir first (a file read, where each `raytp status` is a process of ~2 s of CPU).
    wait_for("the run's first step", lambda: (run_dir / "metrics.jsonl").exists()
             and (run_dir / "metrics.jsonl").read_text().strip(), every=0.2)
    running = wait_for("the run to train", lambda: (s := raytp("status", "long", "--address", head.gcs))
                       and re.search(r"long: running  step [1-9]", s.stdout) and s, every=2)
    assert "Ray job raytp-long: RUNNING" in running.stdout and "TP=2 x DP=1" in running.stdout
    table = raytp("status", "long", "--ranks", "--address", head.gcs).stdout
    assert re.search(r"^\s+0\s+raytp\.long\.rank0\s+\w+\s+\d+", table, re.M), table
    assert re.search(r"^\s+1\s+raytp\.long\.rank1\s", table, re.M), table
    assert sorted(alive_actors(head, "raytp.long.rank")) == ["raytp.long.rank0", "raytp.long.rank1"]

    def series():
        body = urllib.request.urlopen(f"http://127.0.0.1:{head.metrics_port}/metrics", timeout=10).read().decode()
        found = {m.group(1) for m in re.finditer(r'^ray_(raytp_\w+)\{[^}]*run="long"', body, re.M)}
        return found if {"raytp_step", "raytp_loss", "raytp_steps_total", "raytp_world_size"} <= found else None
    assert "raytp_tokens_per_second" in wait_for("raytp_ metrics on the node's endpoint", series, every=2)

    # Every query of the Grafana dashboard has series for this run, which has had no failure: its
    # counters are exported at 0 from the start (a panel says 0, not "No data"). Its model is dense: the
    # expert layers' panel has none.
    from raytp.runtime.driver.metrics import EXPERT_ONLY
    dash = json.loads((ROOT / "grafana" / "raytp.json").read_text())
    exprs = [t["expr"].replace("$run", "long").replace("$__rate_interval", "30s")
             for panel in dash["panels"] for t in panel["targets"]
             if not any(f"raytp_{name}" in t["expr"] for name in EXPERT_ONLY)]

    def empty_queries():
        missing = [e for e in exprs if not prometheus(e)]
        return None if missing else "all"
    try:
        wait_for("every Grafana query to return series", empty_queries, every=2)
    except BaseException:
        raise AssertionError(f"no series for {[e for e in exprs if not prometheus(e)]}") from None
    assert [r["value"][1] for r in prometheus('sum by (run) (ray_raytp_failures_total{run="long"})')] == ["0"]

    scaled = raytp("scale", "long", "--tp", "1", "--address", head.dashboard)
    assert scaled.returncode == 0, scaled.stderr[-3000:]
    assert "now runs at" in scaled.stdout
    assert "TP=1 x DP=1" in raytp("status", "long", "--address", head.dashboard).stdout
    assert wait_for("Ray to show the new layout's one worker",
                    lambda: alive_actors(head, "raytp.long.rank") == ["raytp.long.rank0"] or None)

    stopped = raytp("stop", "long", "--address", head.dashboard)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert re.search(r"long stopped at step \d+; checkpoint \S+; Ray job raytp-long STOPPED", stopped.stdout), \
        stopped.stdout
    after = raytp("status", "long", "--address", head.dashboard)
    assert "long: STOPPED" in after.stdout and "Ray job raytp-long: STOPPED" in after.stdout
    assert any((run_dir / "checkpoints").iterdir())
    assert wait_for("the run's actors and placement groups to go", lambda: leftovers(head, "long") == [] or None)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["status", "nope"], ["logs", "nope"], ["stop", "nope"],
                                     ["scale", "nope", "--tp", "1"]])
def test_unknown_run_is_one_clear_line(head, command):
    address = head.dashboard if command[0] in ("status", "logs") else head.gcs
    p = raytp(*command, "--address", address)
    assert p.returncode == 1
    assert len(p.stderr.strip().splitlines()) == 1 and "'nope'" in p.stderr, p.stderr


@pytest.mark.slow
def test_bad_job_is_rejected_before_submitting(head):
    p = raytp("submit", "jobs/default.yaml", "--address", head.dashboard, "--name", "bad", "--set", "parallel.tp=3")
    assert p.returncode == 2 and "parallel.tp" in p.stderr
    assert raytp("status", "bad", "--address", head.dashboard).returncode == 1  # nothing was submitted
    p = raytp("submit", "jobs/default.yaml", "--address", head.dashboard, "--name", "no/slash")
    assert p.returncode == 2 and "run name" in p.stderr


def test_unreachable_head_fails_fast():
    port = _free_port()  # nothing listens there
    for command in (["status", "x", "--address", f"http://127.0.0.1:{port}"],
                    ["status", "x", "--address", f"127.0.0.1:{port}"],
                    ["logs", "x", "--address", f"http://127.0.0.1:{port}"],
                    ["submit", "jobs/default.yaml", "--address", f"http://127.0.0.1:{port}"]):
        t0 = time.monotonic()
        p = raytp(*command)
        assert p.returncode == 1, (command, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and "answers at" in p.stderr, p.stderr
        assert time.monotonic() - t0 < 60  # not Ray's own retries (minutes); 60: a loaded machine's start
    # A bad job is reported as such even when no head is there: it is checked first.
    p = raytp("submit", "jobs/default.yaml", "--address", f"http://127.0.0.1:{port}", "--set", "train.lr=abc")
    assert p.returncode == 2 and "train.lr" in p.stderr
