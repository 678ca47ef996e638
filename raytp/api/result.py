"""What `raytp.train` returns: a run that ended, as a frozen record."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytp.parallel.layout import Layout


@dataclass(frozen=True)
class Result:
    """A run that ended: `state` "finished", or "stopped" (by `raytp stop` or SIGTERM, with a checkpoint).

    `loss` and `val_loss` are those of the last step, as its metrics.jsonl record has them (a finished
    run is evaluated at its last step; a stopped one may have no `val_loss`); `checkpoint` is the newest whole checkpoint the
    run left (a path or URL), None if it saved none; `layout` is the layout it ended at (a resize may have
    changed it); `events` are events.jsonl's records, oldest first."""
    run: str
    run_dir: Path
    state: str
    steps: int
    loss: float | None
    val_loss: float | None
    seconds: float
    failures: int
    checkpoint: str | None
    layout: Layout
    events: tuple[dict, ...]


def read_events(run_dir: Path) -> tuple[dict, ...]:
    """The records of `run_dir`/events.jsonl, oldest first (none if it has no such file)."""
    try:
        with open(Path(run_dir) / "events.jsonl", encoding="utf-8") as fh:
            return tuple(json.loads(line) for line in fh if line.strip())
    except FileNotFoundError:
        return ()
