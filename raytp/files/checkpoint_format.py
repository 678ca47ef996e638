"""The checkpoint format's names and manifest: what a checkpoint directory holds, without reading a tensor.

Shared by the format-2 reader and writer (raytp.files.checkpoint) and the
format-1 reader (raytp.files.checkpoint_v1). A checkpoint is the directory (or
URL) holding its ``manifest.json``, whatever its name; ``step-NNNNNNNN`` is the
name raytp gives the ones it writes, and what it lists in a checkpoints dir.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict

from raytp.models.args import ModelArgs
from raytp import trust
from raytp.files.storage import Storage

FORMAT, FORMAT_V1 = "raytp-checkpoint/2", "raytp-checkpoint/1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step-(\d{8})")
MAX_MANIFEST = 256 << 20  # bytes: a manifest of a million tensors is ~200 MiB


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or for another model."""


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def shard_file(tp_rank: int, stage: int | None = None, dp_rank: int = 0) -> str:
    """TP rank `tp_rank`'s file (of pipeline stage `stage`, when the checkpoint was written by stages; of DP
    rank `dp_rank` > 0 when the optimizer was sharded over DP, raytp.files.checkpoint_blocks)."""
    name = f"tp{tp_rank:03d}" if stage is None else f"pp{stage:03d}-tp{tp_rank:03d}"
    return f"{name}-dp{dp_rank:03d}.safetensors" if dp_rank else f"{name}.safetensors"


def manifest(step: int, cfg: ModelArgs, tp: int, dp: int, files: dict[str, int], tensors: dict, pp: int = 1,
             zero: int = 0, run_id: str | None = None) -> dict:
    """A format-2 manifest; `run_id`: the run that writes it (it prunes only checkpoints marked with it)."""
    return {"format": FORMAT, "step": step, "time": time.time(), "model": asdict(cfg),
            "layout": {"tp": tp, "pp": pp, "dp": dp, **({"zero": zero} if zero else {})}, "files": files,
            "tensors": tensors, **({"run_id": run_id} if run_id else {})}


def list_checkpoints(storage: Storage) -> list[str]:
    """Names of the checkpoint directories that have a manifest, oldest first."""
    return [n for n in storage.listdir() if STEP_DIR.fullmatch(n) and storage.exists(n, MANIFEST)]


def step_of(name: str) -> int:
    return int(STEP_DIR.fullmatch(name).group(1))


def read_manifest(storage: Storage, directory: str) -> dict:
    where = f"{storage.url.rstrip('/')}/{directory}"
    if not storage.exists(directory):
        raise CheckpointError(f"{where}: no such checkpoint directory")
    if not storage.exists(directory, MANIFEST):
        raise CheckpointError(f"{where}/{MANIFEST}: missing; the checkpoint is incomplete (a save that did not "
                              "finish?)")
    if storage.size(directory, MANIFEST) > MAX_MANIFEST:
        raise CheckpointError(f"{where}/{MANIFEST}: over {MAX_MANIFEST >> 20} MiB: not a manifest raytp wrote")
    try:
        m = json.loads(storage.read_bytes(directory, MANIFEST))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{where}/{MANIFEST}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(m, dict):
        raise CheckpointError(f"{where}/{MANIFEST}: not a JSON object")
    if m.get("format") not in (FORMAT, FORMAT_V1):
        raise CheckpointError(f"{where}/{MANIFEST}: format {m.get('format')!r}, expected {FORMAT!r}")
    return m


def check_model(manifest_: dict, cfg: ModelArgs, where: str) -> None:
    """Refuse a checkpoint of another model shape, naming the keys that differ."""
    saved = asdict(ModelArgs(**manifest_["model"]))  # keys a checkpoint predates take their defaults
    diff = [f"{k} {saved.get(k)} (checkpoint) vs {v} (job)" for k, v in asdict(cfg).items()
            if k != "dropout" and saved.get(k) != v]
    if diff:
        raise CheckpointError(f"{where}/{MANIFEST}: checkpoint is for another model shape: {'; '.join(diff)}")


def check_files(storage: Storage, directory: str, manifest_: dict, where: str) -> None:
    """Every file of a checkpoint there at the size its manifest says (a stat per file; nothing read)."""
    for name, size in manifest_["files"].items():
        if storage.local:  # a plain name (checked with the manifest) that is no link out of the directory
            try:
                trust.inside(storage.path(directory), name, f"{where}/{MANIFEST}: files")
            except trust.Untrusted as e:
                raise CheckpointError(str(e)) from None
        if not storage.exists(directory, name):
            raise CheckpointError(f"{where}/{name}: missing shard file")
        have = storage.size(directory, name)
        if have != size:
            raise CheckpointError(f"{where}/{name}: truncated or altered ({have} bytes, manifest says {size})")
