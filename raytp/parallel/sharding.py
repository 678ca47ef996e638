"""The arithmetic of how a parameter is split over TP ranks: slicing, checkpoints, resharding, norms.

Each model's table (raytp.models: its spec's ``sharding`` rows, looked up by
raytp.models.registry.split_of) maps parameter names to a ``Split``
(raytp.parallel.placements: a ``Shard(dim, parts, pad, heads)`` or
``REPLICATE``): the dim it is split along (REPLICATE's is None), in how many
independent blocks (3 for fused q, k, v: rank i holds heads [i*nh/p, (i+1)*nh/p)
of each), and whether that dim is padded to a multiple of tp (the vocabulary;
padded rows get no probability), and, for the key/value projections of
grouped-query attention, how many whole heads the dim holds: split by KV head
while tp divides them; past that (tp a multiple of the KV heads) each rank holds
a copy of the one KV head its query heads use, and the first rank of those
sharing it is its owner (it writes it; reshards read it).
From it,
``shard_ranges`` says which positions a rank holds, and ``shard_tensor`` /
``unshard_tensors`` apply and invert the split, for weights and optimizer
state alike. Pure: no process groups.
"""
from __future__ import annotations

import math

import torch

from raytp.parallel.placements import Split


def padded_vocab(vocab_size: int, tp: int) -> int:
    return math.ceil(vocab_size / tp) * tp


def shard_ranges(s: Split, size: int, rank: int, tp: int) -> list[range]:
    """The positions along s.dim, of a parameter `size` long there, that TP rank `rank` of `tp` holds, in
    its local order: one range, or one per part (q, k, v). With padding, positions >= size are padding."""
    if s.dim is None or tp == 1:
        return [range(size)]
    if s.pad:
        chunk = padded_vocab(size, tp) // tp
        return [range(rank * chunk, (rank + 1) * chunk)]
    if s.holders(tp) > 1:  # a copy of one whole KV head, that of this rank's query heads
        head, width = rank // s.holders(tp), size // s.heads
        return [range(head * width, (head + 1) * width)]
    block = size // s.parts
    chunk = block // tp
    return [range(p * block + rank * chunk, p * block + (rank + 1) * chunk) for p in range(s.parts)]


def local_shape(s: Split, full_shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of one rank's shard of a parameter of `full_shape`."""
    if s.dim is None or tp == 1:
        return tuple(full_shape)
    shape = list(full_shape)
    shape[s.dim] = sum(len(r) for r in shard_ranges(s, full_shape[s.dim], 0, tp))
    return tuple(shape)


def shard_tensor(full: torch.Tensor, s: Split, rank: int, tp: int) -> torch.Tensor:
    """This rank's slice of a full tensor (a copy; padding positions are zeros)."""
    if s.dim is None or tp == 1:
        return full.detach().clone()
    n = full.shape[s.dim]
    out = full.new_zeros(local_shape(s, tuple(full.shape), tp))
    at = 0
    for r in shard_ranges(s, n, rank, tp):
        real = max(min(r.stop, n) - r.start, 0)
        out.narrow(s.dim, at, real).copy_(full.detach().narrow(s.dim, r.start, real))
        at += len(r)
    return out


def unshard_tensors(shards: list[torch.Tensor], s: Split, full_size: int | None = None) -> torch.Tensor:
    """Inverse of shard_tensor over all ranks' slices, in one copy; `full_size` drops vocab padding."""
    if s.holders(len(shards)) > 1:
        shards = shards[::s.holders(len(shards))]  # the owners' copies
    if s.dim is None or len(shards) == 1:
        out = shards[0].detach().clone()
    else:  # blocks in order: part 0 of every rank, part 1 of every rank, ...
        per_rank = [sh.detach().chunk(s.parts, dim=s.dim) for sh in shards]
        out = torch.cat([pr[p] for p in range(s.parts) for pr in per_rank], dim=s.dim)
    if full_size is not None and s.dim is not None and out.shape[s.dim] != full_size:
        out = out.narrow(s.dim, 0, full_size).clone()
    return out
