"""A real Ray head for the tests that drive the `raytp` command against a cluster, as a user does.

`start_head` (conftest's module fixture `head`) starts one head with `ray start --head --block` on loopback (its own ports and temp
dir, token auth on) and ends it by signalling that process alone: `ray stop` would also end every other Ray
instance on the machine. Every command runs as a fresh `python -m raytp.cli` process (`raytp`).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
SMALL = ["--set", "model.n_layer=2", "--set", "train.eval_interval=0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


# The environment of the Ray processes the tests start in their own processes (conftest sets it; their nodes
# inherit it): no metrics from Ray's own components, and the node reporter's stats once a minute, not every 5 s.
# A node's dashboard agent replays each histogram observation the GCS and raylets export, one by one: a
# test_node_loss head's held ~60% of a core for minutes (py-spy: ReporterAgent._export_histogram_data).
# A real head started here, for the dashboard and Prometheus, keeps both: _env drops these.
TEST_RAY_ENV = {"RAY_enable_metrics_collection": "0", "REPORTER_UPDATE_INTERVAL_MS": "60000"}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", *TEST_RAY_ENV)}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **extra)
    return env


# The ceiling of a command or of a wait for an event: far past a slow, loaded machine, so that a test
# fails when the event never comes, not when it comes slowly.
NEVER_S = 300


def raytp(*args):
    return subprocess.run([sys.executable, "-m", "raytp.cli", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=NEVER_S)


def wait_for(what, fn, every=1.0):
    deadline = time.monotonic() + NEVER_S
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(every)
    pytest.fail(f"timed out after {NEVER_S}s waiting for {what}")


def start_head():
    """Start a head; yield its addresses (gcs, dashboard, metrics_port, temp); end it (conftest's `head`)."""
    # Keep token auth on: make sure a token exists (as ray.init would), and tell the head to use it.
    subprocess.run([RAY, "get-auth-token", "--generate"], capture_output=True, env=_env(), timeout=NEVER_S,
                   check=True)
    gcs, dash, metrics, client, agent = (_free_port() for _ in range(5))
    temp = tempfile.mkdtemp(prefix="rtp", dir="/tmp")  # short: Ray's socket paths live under it
    log = open(Path(temp) / "head.log", "w")
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--metrics-export-port={metrics}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}", "--num-cpus=4",
         "--disable-usage-stats", f"--temp-dir={temp}"],
        env=_env(RAY_AUTH_MODE="token", RAY_metrics_report_interval_ms="2000",
                 RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("the head", lambda: proc.poll() is not None or (_answers(gcs) and _answers(dash) and _answers(agent)))
        assert proc.poll() is None, (Path(temp) / "head.log").read_text()[-3000:]
        yield SimpleNamespace(gcs=f"127.0.0.1:{gcs}", dashboard=f"http://127.0.0.1:{dash}", metrics_port=metrics,
                              temp=temp)
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` tears down the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def in_cluster(head, body: str, check: bool = True):
    """Run `body` in a fresh Python process connected to the head (`ray` and Ray's `state` imported); what its
    last printed line holds as JSON (None if it printed nothing)."""
    code = ("import json, ray; from ray._private import state\n"
            f"ray.init(address={head.gcs!r}, logging_level='ERROR')\n" + body)
    p = subprocess.run([sys.executable, "-c", code], env=_env(RAY_AUTH_MODE="token"), capture_output=True,
                       text=True, timeout=NEVER_S)
    assert p.returncode == 0 or not check, p.stderr[-2000:]
    out = p.stdout.strip().splitlines()
    return json.loads(out[-1]) if out else None


def alive_actors(head, prefix: str) -> list[str]:
    return in_cluster(head, "print(json.dumps([a['Name'] for a in state.actors().values() "
                            f"if a.get('Name', '').startswith({prefix!r}) and a['State'] == 'ALIVE']))")


def leftovers(head, run: str) -> list[str]:
    """The run's actors alive and placement groups not removed."""
    return in_cluster(head, f"pre = {'raytp.' + run + '.'!r}\n"
                            "print(json.dumps([a['Name'] for a in state.actors().values() if a.get('Name', '')"
                            ".startswith(pre) and a['State'] != 'DEAD'] + [g['name'] for g in "
                            "ray.util.placement_group_table().values() if g['name'].startswith(pre) "
                            "and g['state'] != 'REMOVED']))")


def end_runs(head) -> None:
    """Kill every run's coordinator (and so its workers and placement groups) and every raytp actor left."""
    in_cluster(head, "for a in state.actors().values():\n"
                     "    if a.get('Name', '').startswith('raytp.') and a['State'] != 'DEAD':\n"
                     "        ray.kill(ray.get_actor(a['Name'], namespace='raytp'))", check=False)
