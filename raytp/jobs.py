"""Runs as Ray jobs: submit one, then find, follow and stop it by name from any machine.

    raytp submit jobs/gpt2-tp4-dp2.yaml --address http://HEAD:8265 --name gpt2
    raytp status gpt2 --address http://HEAD:8265

A submitted run is the Ray job ``raytp-<run>``. Its entrypoint is ``raytp train``
on the cluster: the job file travels as the job's working_dir, this machine's
raytp package as a py_module (so the cluster runs the code that validated the
job), and the run directory lies outside the job's temporary working dir, under
``~/raytp/runs/<run>`` on the node that runs the driver (the head).

A cluster has two doors. The dashboard (http://HEAD:8265) serves the Jobs API:
submit, job status, logs, stop. The GCS (HEAD:6379) serves actors, hence the
run's control actor: live status, a stop at a step boundary, scale. `Head`
takes either address and derives the other when asked for it, so a laptop that
reaches only a port-forwarded dashboard can still do everything but `scale`.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

JOB_PREFIX = "raytp-"  # the Ray job of run R is raytp-R
RUN_ROOT = "~/raytp/runs"  # where submitted runs keep their run dirs, on the driver's node
GCS_PORT, DASHBOARD_PORT = 6379, 8265  # Ray's defaults, and what cluster.yaml uses
PROBE_TIMEOUT_S = 3.0
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
PROGRESS = re.compile(r"\[raytp\] step (\d+)/(\d+)")
STOPPED = re.compile(r"\[raytp\] stopped at step (\d+)\D[^\n]*?(?:; checkpoint (\S+))?$", re.M)


class Unreachable(Exception):
    """No Ray cluster answers at the address given."""


class NoSuchRun(Exception):
    """The cluster knows no run of that name."""


def submission_id(run: str) -> str:
    return JOB_PREFIX + run


def use_token_if_present() -> None:
    """Send this machine's Ray auth token. Ray 2.60 turns token auth on for the clusters it starts,
    but a client given an explicit address sends the token only under RAY_AUTH_MODE=token."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token")).expanduser()
    if os.environ.get("RAY_AUTH_TOKEN") or path.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
        if "ray" in sys.modules:  # Ray caches its config: refresh it as Ray itself does
            try:
                from ray._raylet import Config
                Config.initialize("")
            except (ImportError, AttributeError):
                pass


def _host_port(address: str, default_port: int) -> tuple[str, int]:
    u = urlparse(address if "://" in address else "//" + address)
    return u.hostname or "127.0.0.1", u.port or default_port


def _answers(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class Head:
    """A cluster's dashboard and GCS, from --address in either form (or RAY_ADDRESS, else the local
    cluster `ray start` made). Connections are made on first use; unreachable ones raise Unreachable."""

    def __init__(self, address: str | None = None):
        use_token_if_present()
        self.given = address or os.environ.get("RAY_ADDRESS") or "auto"
        if self.given.startswith(("http://", "https://")):
            self.dashboard, self.gcs = self.given.rstrip("/"), None
        else:
            self.dashboard, self.gcs = None, self.given
        self._client = None
        self.connected = False

    # -- the two doors ---------------------------------------------------------------
    def client(self):
        """The Jobs API client (the dashboard found through the GCS if only that was given)."""
        if self._client is None:
            if self.dashboard is None:
                self.connect()
                if self.dashboard is None:
                    raise Unreachable(f"the Ray cluster at {self.given!r} runs no dashboard, and Ray Jobs "
                                      "need one (ray start --head --include-dashboard=true)")
            host, port = _host_port(self.dashboard, DASHBOARD_PORT)
            if not _answers(host, port):
                raise Unreachable(f"no Ray dashboard answers at {self.dashboard} (is the cluster up, "
                                  "and the port reachable or forwarded, e.g. `ray dashboard cluster.yaml`?)")
            import logging
            from ray.job_submission import JobSubmissionClient
            for name in ("ray.dashboard.modules.dashboard_sdk", "ray._private.runtime_env.packaging"):
                logging.getLogger(name).setLevel(logging.WARNING)  # "Uploading package ..." lines
            try:
                self._client = JobSubmissionClient(self.dashboard)
            except Exception as e:  # noqa: BLE001 - connection, auth, version: all mean "not usable"
                raise Unreachable(f"no Ray Jobs API at {self.dashboard} ({_first_line(e)})")
        return self._client

    def connect(self) -> None:
        """Join the cluster as a driver, for actors (the GCS derived from the dashboard if need be)."""
        if self.connected:
            return
        if self.gcs is None:
            self.gcs = self._gcs_from_dashboard()
        if self.gcs != "auto":
            host, port = _host_port(self.gcs.removeprefix("ray://"), 10001 if self.gcs.startswith("ray://")
                                    else GCS_PORT)
            if not _answers(host, port):
                via = f" (found through {self.dashboard})" if self.given != self.gcs else ""
                raise Unreachable(f"no Ray GCS answers at {self.gcs}{via}")
        import ray
        try:
            ctx = ray.init(address=self.gcs, namespace="raytp", log_to_driver=False, logging_level="ERROR")
        except Exception as e:  # noqa: BLE001 - ConnectionError, AuthenticationError, ...
            raise Unreachable(f"cannot join the Ray cluster at {self.gcs!r} ({_first_line(e)}); "
                              "pass --address or set RAY_ADDRESS")
        self.connected = True
        url = getattr(ctx, "dashboard_url", None)
        if self.dashboard is None and url:
            self.dashboard = url if url.startswith("http") else f"http://{url}"

    def _gcs_from_dashboard(self) -> str:
        """The GCS address the head's raylet was started with, as the dashboard reports it; failing
        that, Ray's default port on the dashboard's host."""
        try:
            body = self.client()._do_request("GET", "/nodes?view=summary").text
            found = re.search(r"--gcs-address=([\w.\-\[\]:]+)", body)
            if found:
                return found.group(1)
        except Exception:  # noqa: BLE001 - best effort; the default below is what `ray up` uses
            pass
        return f"{_host_port(self.dashboard, DASHBOARD_PORT)[0]}:{GCS_PORT}"

    # -- runs ------------------------------------------------------------------------
    def job(self, run: str):
        """The Ray job of a submitted run (JobDetails), or None if it was never submitted here."""
        try:
            return self.client().get_job_info(submission_id(run))
        except RuntimeError as e:
            if "404" in str(e) or "does not exist" in str(e):
                return None
            raise

    def jobs(self) -> list:
        """Ray jobs of submitted runs, oldest first."""
        return sorted((j for j in self.client().list_jobs() if (j.submission_id or "").startswith(JOB_PREFIX)),
                      key=lambda j: j.start_time or 0)

    def live_status(self, run: str) -> dict | None:
        """The status the run's control actor holds, or None if no driver of that name is running."""
        import ray
        from raytp.runtime.control import find_control
        self.connect()
        ctl = find_control(run)
        if ctl is None:
            return None
        try:
            return ray.get(ctl.get_status.remote(), timeout=30)
        except ray.exceptions.RayActorError:  # it ended just now
            return None

    def logs(self, run: str) -> str:
        return self.client().get_job_logs(submission_id(run))


# -- status ----------------------------------------------------------------------------
def format_live(st: dict) -> str:
    """One line of a running run, from its control actor."""
    def num(key, fmt):
        return format(st[key], fmt) if st.get(key) is not None else "-"
    return (f"{st['run']}: {st['state']}  step {st.get('step', 0)}/{st.get('steps', '?')}  "
            f"TP={st.get('tp', '?')} x DP={st.get('dp', '?')} ({st.get('world_size', '?')} workers)  "
            f"loss {num('loss', '.4f')}  val {num('val_loss', '.4f')}  tok/s {num('tokens_per_s', ',.0f')}  "
            f"failures {st.get('failures', 0)}" + (f"  spares {st['spares']}" if st.get("spares") else "")
            + f"  dir {st.get('run_dir', '-')}")


def progress_of(logs: str) -> tuple[tuple[int, int] | None, str | None]:
    """(step, steps) of the last progress line of a run's log, and its last [raytp] line."""
    steps = PROGRESS.findall(logs)
    lines = [ln.strip() for ln in logs.splitlines() if ln.lstrip().startswith("[raytp]")]
    return ((int(steps[-1][0]), int(steps[-1][1])) if steps else None), (lines[-1] if lines else None)


def stop_point(logs: str) -> dict:
    """{"step", "checkpoint"} of a run's log that says where it stopped, else {}."""
    found = STOPPED.findall(logs)
    return {"step": int(found[-1][0]), "checkpoint": found[-1][1] or None} if found else {}


def describe(head: Head, run: str, job=None, known_job: bool = False) -> list[str]:
    """Lines `raytp status RUN` prints: the control actor's view while the driver runs, and the Ray
    job's status for a submitted run (also after it ended, with the step its log reached)."""
    if not known_job:
        job = job_if_reachable(head, run)
    live = None
    if job is None or not job.status.is_terminal():
        try:
            live = head.live_status(run)
        except Unreachable:
            if job is None:
                raise
    if job is None and live is None:
        raise NoSuchRun(f"no run named {run!r} in this cluster (no Ray job {submission_id(run)}, "
                        "and no running driver of that name); `raytp status` lists the runs it has")
    lines = [format_live(live)] if live else []
    if job is not None:
        status = job.status.value
        if live is None:
            step, last = progress_of(head.logs(run))
            lines.append(f"{run}: {status}" + (f"  step {step[0]}/{step[1]}" if step else ""))
        lines.append(f"  Ray job {submission_id(run)}: {status}" + (f" ({job.message})" if job.message else ""))
        if live is None and last:
            lines.append(f"  last: {last}")
    return lines


def job_if_reachable(head: Head, run: str):
    """The run's Ray job; None if there is none, or if only a GCS address was given and the cluster
    serves no Jobs API (a `raytp train --address` run needs none)."""
    try:
        return head.job(run)
    except Unreachable:
        if head.given.startswith(("http://", "https://")):
            raise
        return None


def all_runs(head: Head) -> list[str]:
    """`raytp status` without RUN: every submitted run (any state), then runs with a live driver."""
    jobs, live, reached = [], [], False
    try:
        jobs, reached = head.jobs(), True
    except Unreachable:
        if head.given.startswith(("http://", "https://")):
            raise
    from raytp.runtime.control import list_runs
    try:
        head.connect()
        live, reached = list_runs(), True
    except Unreachable:
        if not reached:
            raise
    lines, seen = [], set()
    for job in jobs:
        run = job.submission_id[len(JOB_PREFIX):]
        seen.add(run)
        lines += describe(head, run, job, known_job=True)
    for run in live:
        if run not in seen:
            lines += describe(head, run, None, known_job=True)
    return lines


# -- submit ----------------------------------------------------------------------------
@dataclass
class Submission:
    run: str
    run_dir: str
    entrypoint: str
    runtime_env: dict
    metadata: dict

    @property
    def submission_id(self) -> str:
        return submission_id(self.run)


def check_run_name(run: str) -> str | None:
    """A problem with `run` as a Ray job id, actor name and directory name, or None."""
    if not RUN_NAME.fullmatch(run):
        return (f"run name {run!r} is not valid: use letters, digits, '.', '_' and '-', "
                "starting with a letter or digit")
    return None


def make_submission(job_file: Path, sets: tuple[str, ...], run: str, run_dir: str | None,
                    stop_wait_s: float, staging: Path) -> Submission:
    """The Ray job of a run: `job_file` copied into `staging` (shipped as the working_dir), the
    raytp package beside it (py_modules), and `raytp train` as the entrypoint."""
    import raytp
    shutil.copyfile(job_file, staging / job_file.name)
    run_dir = run_dir or f"{RUN_ROOT}/{run}"
    args = ["python", "-m", "raytp.cli", "train", job_file.name, "--name", run, "--run-dir", run_dir]
    for s in sets:
        args += ["--set", s]
    return Submission(
        run=run, run_dir=run_dir, entrypoint=" ".join(shlex.quote(a) for a in args),
        runtime_env={
            "working_dir": str(staging),
            "py_modules": [str(Path(raytp.__file__).resolve().parent)],
            # `stop_job` sends SIGTERM, on which `raytp train` stops at its next step boundary with a
            # checkpoint; give it a call and a save before Ray's SIGKILL (3 s by default).
            "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(int(stop_wait_s))},
        },
        metadata={"raytp_run": run, "raytp_job_file": job_file.name, "raytp_run_dir": run_dir},
    )


def submit(head: Head, sub: Submission) -> str:
    """Submit `sub`; refuses a name already submitted to this cluster."""
    old = head.job(sub.run)
    if old is not None:
        raise FileExistsError(f"a run named {sub.run!r} was already submitted to this cluster (Ray job "
                              f"{sub.submission_id}, {old.status.value}); choose another --name")
    return head.client().submit_job(entrypoint=sub.entrypoint, submission_id=sub.submission_id,
                                    runtime_env=sub.runtime_env, metadata=sub.metadata)
