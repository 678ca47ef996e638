"""The `raytp` command group and what its commands share: loading a job, one-line errors.

A job file is loaded and checked before anything else happens: a bad file or
override exits with status 2 and one line per problem, before Ray starts.
Every failure ends with ``error: ...`` lines naming the key or the file: status
2 for a bad job (nothing was started, or what was is released), 1 for a run
that failed; a Python traceback only with ``raytp --debug``.
"""
from __future__ import annotations

import sys

import click

from raytp import config as config_mod
from raytp.names import check_run_name
from raytp.api import job as api_job
from raytp.api.errors import BadJob, message_of

EXIT_BAD_CONFIG, EXIT_FAILED = 2, 1
DEBUG = {"on": False}


def keys_help() -> str:
    lines = ["\b", "Job file keys (section.key  type  default  help):"]
    for key, typ, default, help_ in config_mod.describe():
        lines.append(f"  {key:<30} {typ:<8} {default:<10} {help_}")
    return "\n".join(lines)


def load_job(job: str, sets: tuple[str, ...]) -> config_mod.JobConfig:
    """The job, checked (exit 2 with a line per problem) and adjusted where a short run needs it (a
    warning per change)."""
    try:
        return api_job.load_job(job, sets, say=lambda line: click.echo(line, err=True))
    except BadJob as e:
        fail(str(e))


@click.group()
@click.version_option(package_name="raytp")
@click.option("--debug", is_flag=True, help="Show Python tracebacks of failures (for bug reports).")
def main(debug):
    """raytp: tensor-parallel GPT training on Ray that survives failures and rescales."""
    DEBUG["on"] = debug


def fail(msg: str, code: int = EXIT_BAD_CONFIG):
    for line in str(msg).splitlines():
        click.echo(f"error: {line}", err=True)
    sys.exit(code)


def failed(e: BaseException, code: int = EXIT_FAILED):
    """End a command on an exception: one `error:` line (its traceback too with --debug)."""
    if DEBUG["on"]:
        import traceback
        traceback.print_exception(e)
    own = type(e).__module__.startswith("raytp")  # raytp's own errors say what is wrong and where
    fail(message_of(e) + ("" if own or DEBUG["on"] else "  (raytp --debug shows the traceback)"), code)


def check_request(run: str | None, timeout: float | None = None, **counts) -> None:
    """A request's arguments before the cluster is asked (exit 2 and one line): RUN a valid run name, a
    --timeout of seconds > 0, every count given (--tp 2: tp=2) at least 1; 0 is not "unchanged"."""
    import math
    problem = check_run_name(run, "RUN") if run is not None else None
    if problem:
        fail(problem)
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
        fail(f"--timeout {timeout:g}: must be a number of seconds > 0")
    for flag, n in counts.items():
        if n is not None and n < 1:
            fail(f"--{flag} {n}: must be at least 1 (leave out what does not change)")


def ended_line(state: str, steps: int, seconds: float, loss, val_loss, run_dir) -> str:
    """The last line of `raytp train` and `raytp attach`: how the run ended."""
    ended = "stopped after" if state == "stopped" else "finished"
    return (f"[raytp] {ended} {steps} steps in {seconds:.1f}s" + (f": loss {loss:.4f}" if loss is not None else "")
            + (f", val_loss {val_loss:.4f}" if val_loss is not None else "") + f"; run dir {run_dir}")
