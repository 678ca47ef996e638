"""Checkpoints that load at any layout.

A checkpoint is a directory ``step-00000100/`` holding one file per TP rank
(``shard-tp<i>.pt``: that rank's slices of the weights and AdamW state; DP
replicas hold the same slices, so only replica 0's are written) and
``manifest.json``, which says how every tensor is split (raytp.parallel.plan's
Sharding), the full shapes, the model shape, the layout and the step.

Exact resumption needs nothing more: data and dropout are pure functions of
(seed, step), and the LR schedule is a function of the step.

Atomic and bounded: everything is written into a hidden temporary directory
beside the final one, fsynced, the manifest last, then renamed into place; a
crash or a full disk mid-save leaves only a ``.tmp-*`` directory, which
loaders ignore and the next save removes. ``keep`` newest are kept.

Why not torch.distributed.checkpoint: DCP reshards DTensors at load time but
needs every rank to see one shared filesystem and a live process group at
both ends; raytp's driver reshards plain tensors in memory (resume, recovery
and elastic resizing share that path), and this format is a few files that
any tool can read with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import torch

from raytp.model import GPTConfig
from raytp.parallel.plan import shard_tensor, sharding_of, unshard_tensors

FORMAT = "raytp-checkpoint/1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step-(\d{8})")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or for another model."""


# -- one rank's state ----------------------------------------------------------------

def shard_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, copy: bool = True) -> dict:
    """This rank's weights and AdamW state, keyed by parameter name, on the CPU.

    With copy=False, CPU tensors are the live ones: only for a caller that serializes them at once
    (a yield to Ray copies them into the object store), which saves a copy per snapshot."""
    params = dict(model.named_parameters())
    by_param = {id(p): n for n, p in params.items()}

    def out(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.clone() if copy and t.device.type == "cpu" else t.cpu()

    optim = {by_param[id(p)]: {k: out(v) for k, v in st.items()} for p, st in optimizer.state.items()}
    return {"model": {n: out(p) for n, p in params.items()}, "optim": optim}


@torch.no_grad()
def load_shard_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Copy a shard_state (of this rank's shapes) into the model and optimizer."""
    params = dict(model.named_parameters())
    missing = set(params) - set(state["model"])
    if missing:
        raise CheckpointError(f"state lacks parameters {sorted(missing)}")
    for n, p in params.items():
        src = state["model"][n]
        if src.shape != p.shape:
            raise CheckpointError(f"{n}: state has shape {tuple(src.shape)}, this shard needs {tuple(p.shape)}")
        p.copy_(src)
    optimizer.state.clear()
    for n, st in state["optim"].items():
        p = params[n]
        # Copies: `state` may be a read-only view of Ray's object store.
        optimizer.state[p] = {k: (v.to(p.device, copy=True) if k != "step" else v.clone()) for k, v in st.items()}


def live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """shard_state's layout holding the live tensors themselves, on their device (no copy)."""
    params = dict(model.named_parameters())
    by_param = {id(p): n for n, p in params.items()}
    optim = {by_param[id(p)]: {k: v.detach() for k, v in st.items()} for p, st in optimizer.state.items()}
    return {"model": {n: p.detach() for n, p in params.items()}, "optim": optim}


def state_bytes(state: dict) -> int:
    """Bytes of a state's tensors (weights and optimizer state)."""
    n = sum(t.numel() * t.element_size() for t in state["model"].values())
    return n + sum(t.numel() * t.element_size() for st in state.get("optim", {}).values() for t in st.values())


def pack_state(state: dict, out: torch.Tensor | None = None) -> dict:
    """A shard_state as one flat byte buffer plus its layout: Ray stores one numpy buffer in a
    single copy, where a dict of tensors costs a pickle per tensor (half the time, measured).
    `out`: a CPU uint8 tensor of state_bytes(state) to pack into (reused, its pages are already
    mapped: a fresh buffer each time cost page faults worth as much as the copy itself)."""
    entries, tensors = [], []
    for section in ("model", "optim"):
        for name, value in state[section].items():
            for key, t in ([(None, value)] if section == "model" else value.items()):
                t = t.detach().contiguous()
                entries.append((section, name, key, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.nbytes))
                tensors.append(t.reshape(-1).view(torch.uint8))
    if not tensors:
        flat = torch.empty(0, dtype=torch.uint8)
    elif out is None:
        flat = torch.cat(tensors).cpu()
    elif not any(t.is_cuda for t in tensors):
        flat = torch.cat(tensors, out=out)
    else:  # tensor by tensor from the device into `out` (pinned: the copies are asynchronous)
        offset = 0
        for t in tensors:
            out[offset:offset + t.numel()].copy_(t, non_blocking=True)
            offset += t.numel()
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream().synchronize()
        flat = out
    return {"packed": entries, "data": flat.numpy()}


def unpack_state(packed: dict) -> dict:
    """Inverse of pack_state (tensors are copies, never views of the buffer)."""
    if "packed" not in packed:
        return packed
    data = torch.from_numpy(packed["data"].copy()) if len(packed["data"]) else torch.empty(0, dtype=torch.uint8)
    out: dict = {"model": {}, "optim": {}}
    offset = 0
    for section, name, key, shape, dtype, nbytes in packed["packed"]:
        t = data[offset:offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
        offset += nbytes
        if section == "model":
            out["model"][name] = t
        else:
            out["optim"].setdefault(name, {})[key] = t
    return out


# -- full (unsharded) state -------------------------------------------------------

def unshard_state(shards: list[dict], cfg: GPTConfig) -> dict:
    """Join the shard_states of all TP ranks (rank order) into the one-device state, padding dropped."""
    def join(name, tensors):
        s = sharding_of(name)
        return unshard_tensors(tensors, s, cfg.vocab_size if s.pad else None)

    model = {n: join(n, [sh["model"][n] for sh in shards]) for n in shards[0]["model"]}
    optim = {}
    for n, st in shards[0]["optim"].items():
        optim[n] = {k: (v.clone() if v.dim() == 0 else join(n, [sh["optim"][n][k] for sh in shards]))
                    for k, v in st.items()}
    return {"model": model, "optim": optim}


def slice_state(full: dict, rank: int, tp: int) -> dict:
    """The shard_state of TP rank `rank` out of a full state (weights, and AdamW state if any)."""
    model = {n: shard_tensor(t, sharding_of(n), rank, tp) for n, t in full["model"].items()}
    optim = {n: {k: (v.clone() if v.dim() == 0 else shard_tensor(v, sharding_of(n), rank, tp))
                 for k, v in st.items()} for n, st in full.get("optim", {}).items()}
    return {"model": model, "optim": optim}


# -- on disk --------------------------------------------------------------------------

def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so that a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, write) -> int:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def save(root: Path, step: int, shards: list[dict], cfg: GPTConfig, tp: int, dp: int, keep: int,
         extra: dict | None = None) -> Path:
    """Write the TP shards of step `step` as root/step-<step>; returns its path. Atomic; prunes to `keep`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files = {}
        for i, sh in enumerate(shards):
            name = f"shard-tp{i}.pt"
            files[name] = _write(tmp / name, lambda f, sh=sh: torch.save(sh, f))
        manifest = {
            "format": FORMAT, "step": step, "time": time.time(), "model": asdict(cfg),
            "layout": {"tp": tp, "dp": dp}, "files": files,
            "tensors": {n: {**asdict(sharding_of(n)), "shape": _full_shape(n, t, tp, cfg)}
                        for n, t in shards[0]["model"].items()},
            **(extra or {}),
        }
        _write(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        fsync_path(tmp)
        if final.exists():  # a save of the same step (e.g. after recovery): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep)
    return final


def _full_shape(name: str, shard: torch.Tensor, tp: int, cfg: GPTConfig) -> list[int]:
    shape, s = list(shard.shape), sharding_of(name)
    if s.dim is not None:
        shape[s.dim] = cfg.vocab_size if s.pad else shape[s.dim] * tp
    return shape


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-looking checkpoint dirs under root (temporaries excluded), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name))


def prune(root: Path, keep: int) -> None:
    for p in list_checkpoints(root)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in Path(root).glob(".tmp-step-*"):  # leftovers of a crashed save
        shutil.rmtree(p, ignore_errors=True)


def read_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    mf = path / MANIFEST
    if not mf.exists():
        raise CheckpointError(f"{mf}: missing; the checkpoint is incomplete (a save that did not finish?)")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mf}: not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mf}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def check_model(manifest: dict, cfg: GPTConfig, where: Path) -> None:
    """Refuse a checkpoint of another model shape, naming the keys that differ."""
    saved = manifest["model"]
    diff = [f"{k} {saved.get(k)} (checkpoint) vs {v} (job)" for k, v in asdict(cfg).items()
            if k != "dropout" and saved.get(k) != v]
    if diff:
        raise CheckpointError(f"{where / MANIFEST}: checkpoint is for another model shape: {'; '.join(diff)}")


def load(path: Path, cfg: GPTConfig | None = None) -> tuple[dict, dict]:
    """(manifest, full one-device state) of a checkpoint dir; validates every file first."""
    path = Path(path)
    manifest = read_manifest(path)
    if cfg is not None:
        check_model(manifest, cfg, path)
    shards = []
    for name, size in manifest["files"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f}: missing shard file")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f}: truncated or altered ({f.stat().st_size} bytes, manifest says {size})")
        try:
            shards.append(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
            raise CheckpointError(f"{f}: cannot be read ({type(e).__name__}: {e})") from None
    full = unshard_state(shards, GPTConfig(**manifest["model"]))
    for n, spec in manifest["tensors"].items():
        if list(full["model"][n].shape) != spec["shape"]:
            raise CheckpointError(f"{path}: tensor {n} has shape {list(full['model'][n].shape)}, "
                                  f"manifest says {spec['shape']}")
    return manifest, full


def load_latest(path: Path, cfg: GPTConfig | None = None, warn=None) -> tuple[Path, dict, dict]:
    """(dir, manifest, full state) of the checkpoint at `path`, or, when `path` is a run dir or a
    checkpoints dir, of the newest checkpoint in it that loads whole; broken ones are reported
    through `warn` and skipped."""
    path = Path(path)
    if (path / MANIFEST).exists() or STEP_DIR.fullmatch(path.name):
        return (path, *load(path, cfg))
    candidates = list_checkpoints(path / "checkpoints") or list_checkpoints(path)
    for p in reversed(candidates):
        try:
            return (p, *load(p, cfg))
        except CheckpointError as e:
            if warn:
                warn(f"skipping {p}: {e}")
    raise CheckpointError(f"{path}: holds no whole checkpoint (looked in {path / 'checkpoints'} and {path})")
