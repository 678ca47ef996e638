"""Context parallelism's cut of a sequence: which tokens each CP rank holds. Pure; no processes.

A sequence of T tokens is cut into ``2 * cp`` equal chunks and CP rank ``i``
holds chunks ``i`` and ``2 * cp - 1 - i`` (Megatron-core's load balance: under a
causal mask a late chunk attends to more keys than an early one, so every rank
pairs one of each and does the same work). A rank's tokens are its two chunks
one after the other; their places in the whole sequence (``positions``) give the
rotary positions and the causal order, so the model sees every token where it
was.
"""
from __future__ import annotations

import torch


def chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 * cp) that CP rank `rank` holds, earlier first."""
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} outside a CP group of {cp}")
    return rank, 2 * cp - 1 - rank


def refusal(length: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> str | None:
    """Why a sequence of `length` tokens cannot be cut over `cp` ranks (None if it can): it must divide into
    2 x cp equal chunks, and each rank's part over TP under sequence parallelism."""
    if cp == 1:
        return None
    need = 2 * cp * (tp if sequence_parallel else 1)
    if length % need:
        what = f"2 x cp x tp = {need}" if sequence_parallel and tp > 1 else f"2 x cp = {need}"
        return (f"model.block_size ({length}) must divide by {what}: context parallelism cuts each sequence into "
                f"2 x cp chunks" + (", each rank's part then over TP (sequence parallelism)"
                                    if sequence_parallel and tp > 1 else ""))
    return None


def positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The places in the whole sequence (of `length` tokens) of CP rank `rank`'s tokens, in its order."""
    size = _chunk(length, cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunks(cp, rank)])


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """CP rank `rank`'s tokens of `x` (the whole sequence along `dim`): its two chunks, one after the other."""
    if cp == 1:
        return x
    size = _chunk(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, c * size, size) for c in chunks(cp, rank)], dim=dim)


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every CP rank's tokens (`parts`, rank 0 first): the inverse of ``shard``."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    size = parts[0].shape[dim] // 2
    ordered: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        first, second = chunks(cp, r)
        ordered[first], ordered[second] = part.narrow(dim, 0, size), part.narrow(dim, size, size)
    return torch.cat(ordered, dim=dim)


def _chunk(length: int, cp: int) -> int:
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not cut into 2 x cp = {2 * cp} equal chunks")
    return length // (2 * cp)
