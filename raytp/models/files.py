"""The one-device model file `raytp export` writes, read back without Ray or a process group.

Format 2 is a safetensors file whose metadata holds the format tag and the
model's ModelArgs (any architecture); format 1, of the first releases, a torch
file (read with ``weights_only``: no pickle is run). ``CausalLM.save`` writes it.
"""
from __future__ import annotations

import json

import torch
from safetensors import safe_open

from raytp.models.args import ModelArgs
from raytp.models.base import MODEL_FORMAT, MODEL_FORMAT_V1, CausalLM
from raytp.models.registry import model_class
from raytp.trust import check_model_size


def load_model(path, map_location="cpu") -> CausalLM:
    """The model in a file written by `raytp export` (or ``CausalLM.save``), in eval mode."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":  # safetensors: an 8-byte length, then the JSON header
        with safe_open(str(path), framework="pt", device=str(map_location)) as f:
            meta = f.metadata() or {}
            if meta.get("format") != MODEL_FORMAT:
                raise ValueError(f"{path}: not a raytp model file (format {MODEL_FORMAT!r})")
            state = {k: f.get_tensor(k) for k in f.keys()}
        cfg = _config(lambda: json.loads(meta["config"]), path)
        return model_class(cfg).from_state_dict(cfg, state, where=str(path)).eval()
    blob = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != MODEL_FORMAT_V1:
        raise ValueError(f"{path}: not a raytp model file (format {MODEL_FORMAT!r})")
    cfg = _config(lambda: blob["config"], path)
    return model_class(cfg).from_state_dict(cfg, blob["model"], where=str(path)).eval()


def _config(read, path) -> ModelArgs:
    """The ModelArgs a model file carries, its size bounded before a model is built (ValueError naming the file)."""
    try:
        cfg = ModelArgs(**read())
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: its config is not a model's ({str(e)[:200]})") from None
    check_model_size(cfg, str(path))
    return cfg
