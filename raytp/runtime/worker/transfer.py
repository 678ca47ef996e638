"""A live TP resize's state moving worker to worker: each byte once, to where it is needed.

Every old rank of replica 0 cuts, for each new TP rank, the slices of its
weights and AdamW state that the new rank's shard is made of (the reshard plan,
raytp.parallel.reshard_plan) and returns them as one packed bundle per new rank
(``export_pieces``, an actor call with one return object per new rank). The
objects are owned by the driver, which passes their references on and never
fetches them; they outlive the processes that made them (a removed rank may
stop at once), and each is pulled only by the nodes of the new ranks that take
it. A new rank fills its empty shard from them one bundle at a time
(``PiecesSource``); a kept process copies its own slices locally (they never
enter the object store unless a rollback might need them). Together the bundles of
old rank i hold all of its shard, so a failed switch can rebuild the old layout
from them (``RebuildSource``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raytp.parallel.reshard_plan import pieces
from raytp.models.registry import sharding_of, tensor_sharding
from raytp.models.stage import holds
from raytp.parallel.sharding import Sharding
from raytp.files.checkpoint import named_tensors


def _full_size(s: Sharding, t: torch.Tensor, tp: int, vocab_size: int) -> int:
    if s.dim is None:
        return t.shape[0] if t.dim() else 1
    return s.full_size(t.shape[s.dim], tp, vocab_size)


def export_pieces(model, optimizer, tp_rank: int, old_tp: int, new_tp: int, vocab_size: int,
                  skip: set[int] = frozenset(), only: int | None = None, stages: list | None = None) -> list[dict]:
    """For each new TP rank j (but those in `skip`; only `only` if given), a bundle of the slices of this
    rank's shard that go there: [(key, src_at, dst_at, tensor)] packed into one buffer. `stages`: the new
    layout's pipeline stages (raytp.models.stage.Stage, or [None] for the whole model): then one bundle per
    (j, stage), j-major, each with only the tensors that stage holds."""
    out = []
    tensors = named_tensors(model, optimizer)
    parts = model.stage_parts()
    for j in range(new_tp):
        for stage in (stages or [None]):
            entries = []
            if j not in skip and (only is None or j == only):
                for key, (s, t) in tensors.items():
                    if stages is not None and not holds(parts, stage, key.split("/")[1]):
                        continue
                    for p in pieces(s, _full_size(s, t, old_tp, vocab_size), old_tp, new_tp, j):
                        if p.src == tp_rank:
                            part = t if s.dim is None else t.narrow(s.dim, p.src_at, p.length)
                            entries.append((key, p.src_at, p.dst_at, part))
            out.append(pack(entries))
    return out


def replicated(model, optimizer) -> dict:
    """A bundle of this rank's replicated tensors alone (what a rebuild of any old rank needs)."""
    return pack([(key, 0, 0, t) for key, (s, t) in named_tensors(model, optimizer).items() if s.dim is None])


def pack(entries: list[tuple[str, int, int, torch.Tensor]]) -> dict:
    """Entries as one flat byte buffer and their layout (Ray stores one numpy buffer in a single copy)."""
    layout, flat = [], []
    for key, src_at, dst_at, t in entries:
        t = t.detach().contiguous().cpu()
        layout.append((key, src_at, dst_at, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.nbytes))
        flat.append(t.reshape(-1).view(torch.uint8))
    data = torch.cat(flat).numpy() if flat else np.empty(0, dtype=np.uint8)
    return {"pieces": layout, "data": data}


def unpack(bundle: dict):
    """(key, src_at, dst_at, tensor) of a bundle; tensors are views of its buffer (copy them out)."""
    data = torch.from_numpy(bundle["data"]) if len(bundle["data"]) else torch.empty(0, dtype=torch.uint8)
    at = 0
    for key, src_at, dst_at, shape, dtype, nbytes in bundle["pieces"]:
        yield key, src_at, dst_at, data[at:at + nbytes].view(getattr(torch, dtype)).reshape(shape)
        at += nbytes


def bundle_bytes(bundle: dict) -> int:
    return int(bundle["data"].nbytes)


class _Targets:
    """The tensors of an empty shard to fill, by key; AdamW state entries are made as their pieces come."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.params = dict(model.named_parameters())

    def get(self, key: str, like: torch.Tensor) -> tuple[torch.Tensor, Sharding]:
        section, name, *k = key.split("/")
        p = self.params[name]
        if section == "model":
            return p.data, sharding_of(name, self.model.cfg)
        state = self.optimizer.state_of(name)  # the whole parameter's: a live resize runs at zero 0
        if k[0] not in state:
            state[k[0]] = torch.zeros((), dtype=like.dtype) if like.dim() == 0 else torch.zeros_like(p.data)
        t = state[k[0]]
        return t, tensor_sharding(name, t, self.model.cfg)


def _copy(targets: _Targets, key: str, at: int, t: torch.Tensor) -> None:
    dst, s = targets.get(key, t)
    with torch.no_grad():
        if s.dim is None:
            dst.copy_(t)
        else:
            dst.narrow(s.dim, at, t.shape[s.dim]).copy_(t)


@dataclass(frozen=True)
class PiecesSource:
    """What new TP rank j's shard is made of: the bundles for j from each old rank (refs; None where the
    slices are this process's own, taken from `own`: (model, optimizer, old TP rank, old TP degree))."""
    refs: tuple
    vocab_size: int

    def fill(self, model, optimizer, rank: int, tp: int, own=None) -> None:
        import ray
        targets = _Targets(model, optimizer)
        if own is not None:
            old_model, old_opt, old_rank, old_tp = own
            own_part = export_pieces(old_model, old_opt, old_rank, old_tp, tp, self.vocab_size, only=rank % tp)
            for key, _, dst_at, t in unpack(own_part[rank % tp]):
                _copy(targets, key, dst_at, t)
        for ref in self.refs:
            if ref is None:
                continue
            for key, _, dst_at, t in unpack(ray.get(ref)):  # one bundle in memory at a time
                _copy(targets, key, dst_at, t)


@dataclass(frozen=True)
class RebuildSource:
    """An old rank's shard again (a failed switch rolls back), from the bundles it exported (`refs`, one
    per new rank: each piece goes back to where it came from, its src_at) and old rank 0's bundle of the
    replicated tensors (`replicated`)."""
    refs: tuple
    replicated: object

    def fill(self, model, optimizer, rank: int, tp: int, own=None) -> None:
        import ray
        targets = _Targets(model, optimizer)
        for ref in (self.replicated, *self.refs):
            for key, src_at, _, t in unpack(ray.get(ref)):
                if ref is self.replicated or tensor_sharding(key.split("/")[1], t, model.cfg).dim is not None:
                    _copy(targets, key, src_at, t)
