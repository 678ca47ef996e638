"""`raytp export`: one unsharded model from a checkpoint, written tensor by tensor.

Each tensor is read whole from the checkpoint's slices (raytp.train.checkpoint,
TP degree 1) and written to the output file at once, so the export holds one
tensor at a time, never the model. The raytp format is a safetensors file with
the model's config in its metadata (``raytp.model.GPT.load`` reads it); the
Hugging Face format is raytp.train.hf.save.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from raytp.model import MODEL_FORMAT
from raytp.train import safetensors_io


def write_model(ckpt, out: Path, tokenizer: Path | None = None) -> int:
    """The weights of `ckpt` (a Checkpoint) as a raytp model file at `out`, with the text of `tokenizer`
    (a tokenizer.json) in its metadata so that `raytp sample` finds it; bytes written."""
    items = []
    for key in ckpt.keys():
        if not key.startswith("model/"):
            continue
        spec = ckpt.manifest.get("tensors", {}).get(key)
        t_shape = tuple(spec["shape"]) if spec else None
        if t_shape is None:  # a format-1 checkpoint: shapes from the tensors themselves
            t_shape = tuple(ckpt.read(key, 0, 1).shape)
        dtype = safetensors_io.TORCH[spec["dtype"]] if spec else torch.float32
        items.append((key.removeprefix("model/"), dtype, t_shape, lambda key=key: ckpt.read(key, 0, 1)))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": MODEL_FORMAT, "config": json.dumps(ckpt.manifest["model"])}
    if tokenizer is not None:
        meta["tokenizer"] = Path(tokenizer).read_text()
    with open(out, "wb") as f:
        return safetensors_io.write(f, items, meta)


def embedded_tokenizer(model_file) -> str | None:
    """The tokenizer.json text a raytp model file carries, if any."""
    with open(model_file, "rb") as f:
        if f.read(9)[8:9] != b"{":
            return None  # a format-1 torch file: byte level
    from safetensors import safe_open
    with safe_open(str(model_file), framework="pt") as f:
        return (f.metadata() or {}).get("tokenizer")
