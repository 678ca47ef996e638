"""Format-1 checkpoints (raytp-checkpoint/1): one ``torch.save`` pickle per TP rank, read whole.

Kept so that checkpoints written before format 2 still resume and export. Each
reader loads every shard file (``torch.load(weights_only=True)``: tensors only,
no code) and cuts its slices from the joined state: whole-model memory, once;
the next save writes format 2.
"""
from __future__ import annotations

import io

import torch

from raytp.model import GPTConfig
from raytp.train.checkpoint import CheckpointError, Checkpoint
from raytp.train.shard_state import slice_state, unshard_state


class LegacyCheckpoint(Checkpoint):
    def __init__(self, storage, directory: str, manifest_: dict):
        super().__init__(storage, directory, manifest_)
        self._full: dict | None = None

    def _state(self) -> dict:
        if self._full is None:
            shards = []
            for name in self.manifest["files"]:
                try:
                    raw = self.storage.read_bytes(self.dir, name)
                    shards.append(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True))
                except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
                    raise CheckpointError(f"{self.where}/{name}: cannot be read ({type(e).__name__}: {e})") from None
            self._full = unshard_state(shards, GPTConfig(**self.manifest["model"]))
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
