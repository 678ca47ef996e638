"""Runs as Ray jobs: submit one, then find, follow and stop it by name from any machine.

    raytp submit jobs/gpt2-tp4-dp2.yaml --address http://HEAD:8265 --name gpt2
    raytp status gpt2 --address http://HEAD:8265

A submitted run is the Ray job ``raytp-<run>``. Its entrypoint is ``raytp train``
on the cluster: the job file travels as the job's working_dir, this machine's
raytp package as a py_module (so the cluster runs the code that validated the
job), and the run directory lies outside the job's temporary working dir, under
``~/raytp/runs/<run>`` on the node that runs the driver (the head). The cluster
is reached through raytp.head.Head.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from raytp import names
from raytp.trust import Untrusted, load_yaml
from raytp.head import Head, Unreachable

__all__ = ["Head", "NoSuchRun", "Unreachable"]  # and the functions below

RUN_ROOT = "~/raytp/runs"  # where submitted runs keep their run dirs, on the driver's node
PROGRESS = re.compile(r"\[raytp\] step (\d+)/(\d+)")


class NoSuchRun(Exception):
    """The cluster knows no run of that name."""


def submission_id(run: str) -> str:
    return names.ray_job(run)


# -- status ----------------------------------------------------------------------------
def format_live(st: dict) -> str:
    """One line of a running run, from its control actor."""
    def num(key, fmt):
        return format(st[key], fmt) if st.get(key) is not None else "-"
    return (f"{st['run']}: {st['state']}  step {st.get('step', 0)}/{st.get('steps', '?')}  "
            f"TP={st.get('tp', '?')} x " + (f"PP={st['pp']} x " if (st.get("pp") or 1) > 1 else "")
            + f"DP={st.get('dp', '?')} ({st.get('world_size', '?')} workers)  "
            f"loss {num('loss', '.4f')}  val {num('val_loss', '.4f')}  tok/s {num('tokens_per_s', ',.0f')}  "
            f"failures {st.get('failures', 0)}" + (f"  spares {st['spares']}" if st.get("spares") else "")
            + f"  dir {st.get('run_dir', '-')}" + (f"\n  client: {st['client']}" if st.get("client") else ""))


def progress_of(logs: str) -> tuple[tuple[int, int] | None, str | None]:
    """(step, steps) of the last progress line of a run's log, and its last [raytp] line."""
    steps = PROGRESS.findall(logs)
    lines = [ln.strip() for ln in logs.splitlines() if ln.lstrip().startswith("[raytp]")]
    return ((int(steps[-1][0]), int(steps[-1][1])) if steps else None), (lines[-1] if lines else None)


def format_ranks(st: dict) -> list[str]:
    """`raytp status RUN --ranks`: which process holds which rank (actor names cannot follow a rank that
    moved to a warm spare or was renumbered by an elastic shrink; this table does)."""
    rows = [("rank", "actor", "node", "pid", "gpu")]
    for r in st.get("ranks", []):
        rows.append((str(r.get("rank")), r.get("actor") or "-", (r.get("node_id") or "-")[:12], str(r.get("pid")),
                     ",".join(map(str, r.get("gpu_ids") or [])) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]


def describe(head: Head, run: str, job=None, known_job: bool = False, ranks: bool = False) -> list[str]:
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
    lines = [format_live(live)] + (format_ranks(live) if ranks else []) if live else []
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
    from raytp.runtime.driver.control_actor import list_runs
    try:
        head.connect()
        live, reached = list_runs(), True
    except Unreachable:
        if not reached:
            raise
    lines, seen = [], set()
    for job in jobs:
        run = job.submission_id[len(names.JOB_PREFIX):]
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


def read_runtime_env(text: str) -> dict:
    """A user's Ray runtime env: a YAML or JSON file, or inline JSON. ValueError (saying what is wrong) for one
    that is not a mapping, sets raytp's own `working_dir`, or has env_vars that are not strings."""
    path = Path(text)
    try:
        env = load_yaml(path.read_text(), str(path)) if path.is_file() else json.loads(text)
    except (OSError, yaml.YAMLError, json.JSONDecodeError, Untrusted) as e:
        raise ValueError(f"neither a readable YAML/JSON file nor inline JSON ({type(e).__name__}: {e})") from None
    if not isinstance(env, dict):
        raise ValueError(f"must be a mapping of runtime env fields, got {type(env).__name__}")
    if "working_dir" in env:
        raise ValueError("working_dir is raytp's (it ships the job file); put code in py_modules or pip instead")
    bad = {k: v for k, v in (env.get("env_vars") or {}).items() if not isinstance(v, str)}
    if bad:
        raise ValueError(f"env_vars values must be strings (quote them): {sorted(bad)}")
    return env


def make_submission(job_file: Path, sets: tuple[str, ...], run: str, run_dir: str | None,
                    stop_wait_s: float, staging: Path, resume: str | None = None, extra: dict | None = None
                    ) -> Submission:
    """The Ray job of a run: `job_file` copied into `staging` (shipped as the working_dir), the
    raytp package beside it (py_modules), and `raytp train` as the entrypoint (with `--resume`, as
    train takes it: "latest" for the run dir's own checkpoints, or a path or URL on the cluster). `extra`: the
    user's runtime env (read_runtime_env), merged in: its env_vars and py_modules beside raytp's, the rest as
    given. Actors inherit their job's runtime env, so every worker has it too."""
    import raytp
    shutil.copyfile(job_file, staging / job_file.name)
    run_dir = run_dir or f"{RUN_ROOT}/{run}"
    args = ["python", "-m", "raytp.cli", "train", job_file.name, "--name", run, "--run-dir", run_dir]
    for s in sets:
        args += ["--set", s]
    if resume is not None:
        args += ["--resume"] + ([] if resume == "latest" else [resume])
    extra = dict(extra or {})
    return Submission(
        run=run, run_dir=run_dir, entrypoint=" ".join(shlex.quote(a) for a in args),
        runtime_env={
            **extra,
            "working_dir": str(staging),
            "py_modules": [str(Path(raytp.__file__).resolve().parent), *extra.get("py_modules", [])],
            # `stop_job` sends SIGTERM, on which `raytp train` stops at its next step boundary with a
            # checkpoint; give it a call and a save before Ray's SIGKILL (3 s by default).
            "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(int(stop_wait_s)), **(extra.get("env_vars") or {})},
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
