"""The names raytp gives things in Ray and on disk, in one place.

Scripts, dashboards and the CLI find a run's parts by these names (the README's
"Ray names"): every actor of run R lives in the Ray namespace ``raytp`` and is
called ``raytp.<R>.<role>``.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

NAMESPACE = "raytp"
PREFIX = "raytp."
JOB_PREFIX = "raytp-"  # the Ray job of a submitted run R is raytp-R
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MAX_RUN_NAME = 128


def worker(run: str, rank: int) -> str:
    return f"{PREFIX}{run}.rank{rank}"


def worker_moved(run: str, rank: int, k: int) -> str:
    """A worker started for rank R on another node while the running rank R holds its name (the k-th move
    of a copy off its twin's node, raytp.runtime.recovery.respread)."""
    return f"{worker(run, rank)}.moved{k}"


def worker_ahead(run: str, rank: int, k: int) -> str:
    """A worker started for rank R of the next layout while the running layout's rank R holds its name (the
    k-th resize of the run that starts every worker ahead); its repr shows the rank it holds."""
    return f"{worker(run, rank)}.next{k}"


def spare(run: str, k: int) -> str:
    return f"{PREFIX}{run}.spare{k}"


def keeper(run: str, k: int) -> str:
    """The actor holding the off-node copy of the newest snapshot."""
    return f"{PREFIX}{run}.snapshots{k}"


def control(run: str) -> str:
    return f"{PREFIX}{run}.control"


def coordinator(run: str) -> str:
    """The detached actor that drives a run joined to a cluster (raytp.runtime.coordinator)."""
    return f"{PREFIX}{run}.coordinator"


def run_of_control(name: str) -> str | None:
    """The run whose control actor is called `name`, or None."""
    if name.startswith(PREFIX) and name.endswith(".control"):
        return name[len(PREFIX):-len(".control")]
    return None


def ray_job(run: str) -> str:
    """The Ray job (submission id) of a submitted run."""
    return JOB_PREFIX + run


def replica_group(run: str, dp_rank: int, generation: int) -> str:
    """The placement group of one DP replica (generations keep names unique while a resize holds two)."""
    return f"{PREFIX}{run}.replica{dp_rank}.{generation}"


def extension_group(run: str, dp_rank: int, generation: int) -> str:
    """More bundles for a replica whose TP degree grows (Ray cannot grow a placement group)."""
    return f"{PREFIX}{run}.replica{dp_rank}.ext{generation}"


def spares_group(run: str) -> str:
    return f"{PREFIX}{run}.spares"


def default_run_name(job_file: str | Path) -> str:
    """<job file stem>-<local time>, e.g. default-20261201-081500."""
    return f"{Path(job_file).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_name(run: str, what: str = "run name") -> str | None:
    """What is wrong with `run` as an actor name, Ray job id and directory name; None if nothing (every
    entry point asks this: --name, the job's name, a run dir's last component, submit)."""
    if isinstance(run, str) and RUN_NAME.fullmatch(run) and len(run) <= MAX_RUN_NAME:
        return None
    shown = repr(run) if len(repr(run)) <= 60 else repr(run)[:57] + "..."
    return (f"{what} {shown} is not valid: use at most {MAX_RUN_NAME} ASCII letters, digits, '.', '_' and '-', "
            "starting with a letter or digit")
