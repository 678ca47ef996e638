"""Whose checkpoints these are: a run marks what it writes and removes only what it marked.

A checkpoint location may be shared (two runs given one ``checkpoint.dir``, a team's bucket), so a run
proves ownership before it deletes: each run has an id (``run_id`` in its run directory, kept across
``--resume`` of that run dir; adopted from the checkpoint a bare ``--resume`` continues when the run dir
lost it), written into every manifest it commits and into the names of its hidden temporary save
directories (``.tmp-step-NNNNNNNN-<run id>-<random>``). ``prune`` removes only checkpoints whose manifest
names this run and only temporary directories whose name does; a checkpoint written before run ids
existed (no ``run_id`` in its manifest) is never removed, whoever wrote it: it still loads and resumes,
and is left for the user to delete. ``foreign`` lists what a fresh run would share a location with.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

from raytp import trust
from raytp.files.checkpoint_format import MANIFEST, STEP_DIR, list_checkpoints
from raytp.files.storage import Storage

RUN_ID_FILE = "run_id"


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def read_run_id(run_dir) -> str | None:
    """The id a run dir keeps, if it keeps a valid one."""
    f = Path(run_dir) / RUN_ID_FILE
    try:
        text = f.read_text().strip() if f.is_file() and f.stat().st_size < 256 else None
    except (OSError, UnicodeDecodeError):
        return None
    return text if text and trust.NAME.fullmatch(text) else None


def keep_run_id(run_dir, run_id: str) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / RUN_ID_FILE).write_text(run_id + "\n")


def written_by(storage: Storage, name: str) -> str | None:
    """The run id in checkpoint `name`'s manifest; None for one without (written before run ids) or unreadable."""
    try:
        m = json.loads(storage.read_bytes(name, MANIFEST))
    except Exception:  # noqa: BLE001 - unreadable, not JSON, gone: provably nobody's, so never ours
        return None
    run_id = m.get("run_id") if isinstance(m, dict) else None
    return run_id if isinstance(run_id, str) else None


def temp_dir(step_name: str, run_id: str) -> str:
    """The hidden directory a save of `step_name` is written in on a filesystem, named for its run."""
    return f".tmp-{step_name}-{run_id}-{uuid.uuid4().hex[:8]}"


def prune(storage: Storage, keep: int, run_id: str | None = None, in_flight: str | None = None) -> list[str]:
    """Keep run `run_id`'s `keep` newest checkpoints: remove its older ones and its saves cut short (hidden
    temporary directories named for it, but `in_flight`). Nothing another run wrote, nothing unmarked. The
    names removed (none without a `run_id`: nothing is provably ours)."""
    if run_id is None:
        return []
    mine = [n for n in list_checkpoints(storage) if written_by(storage, n) == run_id]
    gone = mine[:-keep] if keep > 0 else mine
    for name in storage.listdir():
        if name.startswith(".tmp-step-") and f"-{run_id}-" in name and name != in_flight:
            gone.append(name)
    for name in gone:
        storage.remove(name)
    return gone


def foreign(storage: Storage, run_id: str | None) -> list[str]:
    """The checkpoints at `storage` not marked with `run_id` (another run's, or unmarked ones)."""
    return [n for n in list_checkpoints(storage) if run_id is None or written_by(storage, n) != run_id]


def holds_checkpoints(storage: Storage) -> bool:
    """Whether `storage` holds any step directory (whole or not)."""
    return any(STEP_DIR.fullmatch(n) for n in storage.listdir())
