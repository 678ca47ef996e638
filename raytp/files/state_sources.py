"""Where a shard's first state comes from, when not from the seeded initialisation.

A source is a small picklable description handed to every worker, which reads
its own slices from it (``fill``): no process ever holds the whole state.

- ``CheckpointSource``: a checkpoint (any layout, either format): each worker
  reads only the byte ranges of its new slices.
- ``HFSource``: a Hugging Face GPT-2 directory (``model.init_from``): each
  worker reads its slices of ``model.safetensors``.
- ``StateSource``: a one-device state in memory (or its ObjectRef), sliced by
  each worker: for tests and small models only.
"""
from __future__ import annotations

from dataclasses import dataclass

from raytp.files import checkpoint
from raytp.files.interop import hf
from raytp.train.shard_state import load_shard_state, slice_state
from raytp.files.storage import Storage


@dataclass(frozen=True)
class CheckpointSource:
    url: str          # the Storage holding the checkpoint directory
    directory: str
    manifest: dict

    @classmethod
    def of(cls, ckpt) -> "CheckpointSource":
        return cls(ckpt.storage.url, ckpt.dir, ckpt.manifest)

    @property
    def where(self) -> str:
        return f"{self.url.rstrip('/')}/{self.directory}"

    def fill(self, model, optimizer, rank: int, tp: int) -> None:
        ckpt = checkpoint.open_checkpoint(Storage(self.url), self.directory, self.manifest)
        checkpoint.load_into(ckpt, model, optimizer, rank, tp)


@dataclass(frozen=True)
class HFSource:
    path: str

    def fill(self, model, optimizer, rank: int, tp: int) -> None:
        hf.load_into(self.path, model, rank, tp)


@dataclass(frozen=True)
class StateSource:
    state: object     # {"model": {...}, "optim": {...}} of the one-device model

    def fill(self, model, optimizer, rank: int, tp: int) -> None:
        load_shard_state(model, optimizer, slice_state(self.state, rank, tp, model.cfg), whole=True)
