"""A Ray cluster's two doors, from one address: the dashboard (Jobs API) and the GCS (actors).

The dashboard (http://HEAD:8265) serves the Jobs API: submit, job status, logs,
stop. The GCS (HEAD:6379) serves actors, hence a run's control actor: live
status, a stop at a step boundary, scale. ``Head`` takes either address and
derives the other when asked for it, so a laptop that reaches only a
port-forwarded dashboard can still do everything but `scale`.
"""
from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from raytp import names

GCS_PORT, DASHBOARD_PORT = 6379, 8265  # Ray's defaults, and what cluster.yaml uses
PROBE_TIMEOUT_S = 3.0


class Unreachable(Exception):
    """No Ray cluster answers at the address given."""


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
            ctx = ray.init(address=self.gcs, namespace=names.NAMESPACE, log_to_driver=False, logging_level="ERROR")
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
            return self.client().get_job_info(names.ray_job(run))
        except RuntimeError as e:
            if "404" in str(e) or "does not exist" in str(e):
                return None
            raise

    def jobs(self) -> list:
        """Ray jobs of submitted runs, oldest first."""
        return sorted((j for j in self.client().list_jobs() if (j.submission_id or "").startswith(names.JOB_PREFIX)),
                      key=lambda j: j.start_time or 0)

    def live_status(self, run: str) -> dict | None:
        """The status the run's control actor holds, or None if no driver of that name is running."""
        import ray
        from raytp.runtime.driver.control_actor import find_control
        self.connect()
        ctl = find_control(run)
        if ctl is None:
            return None
        try:
            return ray.get(ctl.get_status.remote(), timeout=30)
        except ray.exceptions.RayActorError:  # it ended just now
            return None

    def logs(self, run: str) -> str:
        return self.client().get_job_logs(names.ray_job(run))
