"""Format-1 checkpoints (raytp-checkpoint/1): one ``torch.save`` pickle per TP rank, read whole.

Kept so that checkpoints written before format 2 still resume and export. Each
reader loads every shard file (``torch.load(weights_only=True)``: tensors only,
no code) and cuts its slices from the joined state: whole-model memory, once;
the next save writes format 2.
"""
from __future__ import annotations

import io

import torch

from raytp.models.args import ModelArgs
from raytp.files.checkpoint_format import CheckpointError, check_files
from raytp.train.shard_state import slice_state, unshard_state


class LegacyCheckpoint:
    """A format-1 checkpoint directory, with the reading side of raytp.files.checkpoint.Checkpoint."""

    reads_into = False  # read() returns a new tensor

    def __init__(self, storage, directory: str, manifest_: dict):
        self.storage, self.dir, self.manifest = storage, directory, manifest_
        self.where = f"{storage.url.rstrip('/')}/{directory}"
        self.step, self.tp = manifest_["step"], manifest_["layout"]["tp"]
        self._full: dict | None = None

    def validate(self) -> "LegacyCheckpoint":
        check_files(self.storage, self.dir, self.manifest, self.where)
        return self

    def check_all(self) -> "LegacyCheckpoint":
        return self  # each file is read whole, with weights_only, when first asked

    def _state(self) -> dict:
        if self._full is None:
            shards = []
            for name in self.manifest["files"]:
                try:
                    raw = self.storage.read_bytes(self.dir, name)
                    shards.append(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True))
                except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
                    raise CheckpointError(f"{self.where}/{name}: cannot be read ({type(e).__name__}: {e})") from None
            self._full = unshard_state(shards, ModelArgs(**self.manifest["model"]))
        return self._full

    def keys(self) -> list[str]:
        full = self._state()
        return [f"model/{n}" for n in full["model"]] + [f"optim/{n}/{k}" for n, st in full["optim"].items()
                                                        for k in st]

    def read(self, key: str, rank: int, tp: int) -> torch.Tensor:
        section, name, *k = key.split("/")
        full = self._state()
        part = slice_state({"model": {name: full["model"][name]}, "optim": {name: full["optim"].get(name, {})}},
                           rank, tp)
        return part["model"][name] if section == "model" else part["optim"][name][k[0]]
