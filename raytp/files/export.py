"""`raytp export`: one unsharded model from a checkpoint, written tensor by tensor.

Each tensor is read whole from the checkpoint's slices (raytp.files.checkpoint,
TP degree 1) and written to the output file at once, so the export holds one
tensor at a time, never the model. The raytp format is a safetensors file with
the model's config in its metadata (``raytp.models.files.load_model`` reads it); the
Hugging Face format is raytp.files.hf.save.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from raytp.models.base import MODEL_FORMAT
from raytp.files import safetensors_io


def unmap_large_frees() -> None:
    """Make every allocation of 1 MiB or more a mapping of its own, returned to the system when freed.
    glibc otherwise raises that threshold to the largest block freed so far, after which freed tensors
    stay in the heap and a larger one grows it: an export would hold two tensors' worth. Exports are
    I/O-bound, so the page faults this costs do not show (a training step's allocations would)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: its own policy


def write_model(ckpt, out: Path, tokenizer: Path | None = None) -> int:
    """The weights of `ckpt` (a Checkpoint) as a raytp model file at `out`, with the text of `tokenizer`
    (a tokenizer.json) in its metadata so that `raytp sample` finds it; bytes written."""
    unmap_large_frees()
    items = []
    for key in ckpt.keys():
        if not key.startswith("model/"):
            continue
        spec = ckpt.manifest.get("tensors", {}).get(key)
        t_shape = tuple(spec["shape"]) if spec else None
        if t_shape is None:  # a format-1 checkpoint: shapes from the tensors themselves
            t_shape = tuple(ckpt.read(key, 0, 1).shape)
        dtype = safetensors_io.TORCH[spec["dtype"]] if spec else torch.float32
        items.append((key.removeprefix("model/"), dtype, t_shape,
                      lambda key=key, spec=spec: _whole(ckpt, key, spec)))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": MODEL_FORMAT, "config": json.dumps(ckpt.manifest["model"])}
    if tokenizer is not None:
        meta["tokenizer"] = Path(tokenizer).read_text()
    with open(out, "wb") as f:
        return safetensors_io.write(f, items, meta)


def _whole(ckpt, key: str, spec: dict | None):
    """Tensor `key` whole, in its model layout. One stored transposed (a row-parallel weight, split dim
    first) is read as stored and handed out as its transpose 64 rows at a time: one copy in memory."""
    if not (spec and spec.get("transposed")):
        return ckpt.read(key, 0, 1)
    stored = ckpt.read(key, 0, 1, stored=True)  # (in, out)
    return (stored[:, i:i + 64].t() for i in range(0, stored.shape[1], 64))


def embedded_tokenizer(model_file) -> str | None:
    """The tokenizer.json text a raytp model file carries, if any."""
    with open(model_file, "rb") as f:
        if f.read(9)[8:9] != b"{":
            return None  # a format-1 torch file: byte level
    from safetensors import safe_open
    with safe_open(str(model_file), framework="pt") as f:
        return (f.metadata() or {}).get("tokenizer")
