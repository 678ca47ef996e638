"""What `raytp.train` raises, where `raytp train` exits non-zero.

The message of each error is what the command prints after ``error:`` (one line per line of it).

    BadJob     exit 2: the job cannot run as written; nothing was started, or what was is released
    RunFailed  exit 1: the run started and failed; its run directory says how (events.jsonl)
    Interrupted  exit 130: Ctrl-C during the run (a KeyboardInterrupt); the workers are released
"""
from __future__ import annotations

from pathlib import Path


class TrainError(Exception):
    """A job that `raytp.train` could not run to its end; `exit_code` is the command line's status."""
    exit_code = 1


class BadJob(TrainError):
    """The job cannot run as written: a bad key or value, data the model cannot read, a checkpoint
    location that cannot be written, a layout no node has the memory for, a run dir already in use."""
    exit_code = 2


class RunFailed(TrainError):
    """The run started and failed (its cause is the exception's ``__cause__``)."""

    def __init__(self, message: str, run_dir: Path):
        super().__init__(message)
        self.run_dir = run_dir


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while the job ran: the workers are released and the run directory is kept."""
    exit_code = 130

    def __init__(self, run_dir: Path):
        super().__init__(f"interrupted; workers released, run dir {run_dir} kept")
        self.run_dir = run_dir


def message_of(e: BaseException) -> str:
    """What an exception that ended a run says of itself: raytp's own errors whole (they name what is
    wrong and where), anyone else's as its type and first line."""
    return message_from(type(e).__module__, type(e).__name__, str(e))


def message_from(module: str, name: str, text: str) -> str:
    """message_of an exception of type `module.name` saying `text` (one raised in another process)."""
    if module.startswith("raytp"):
        return text.strip() or name
    first = (text.strip().splitlines() or [""])[0]
    return f"{name}: {first}"
