"""A plan's two halves on the workers: one export on each source, one fill on each destination.

``export(tensors, moves)``: a source rank (an old rank's process, or whoever
serves an old rank's snapshot or checkpoint part) cuts the blocks it is the
source of out of its local tensors ({key: tensor}) and packs them into one
bundle per destination rank: a flat byte buffer and, per block, its key, where
it goes and its shape and dtype, each block 8-byte aligned (Ray keeps one numpy buffer as a single copy;
no pickle of tensors). Moves in place are not exported: the destination's own
process has those bytes.

``fill(targets, own, moves, bundles, parts)``: a destination rank writes its
in-place moves from its own old tensors (`own`; a block that is already where it
goes is left as it is), every block of the bundles sent to it, and the blocks
planned from snapshots from the snapshot parts (`parts`: (old rank, its tensors)
pairs, one part in memory at a time) into its local tensors (`targets`: {key:
tensor} of the new shapes), one bundle at a time.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np
import torch

from raytp.moves.planner import Move, SourceKind

ALIGN = 8  # bytes: each block of a bundle starts at a multiple of it


def _block(t: torch.Tensor, at: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
    for d, (a, n) in enumerate(zip(at, size)):
        t = t.narrow(d, a, n)
    return t


def export(tensors: Mapping[str, torch.Tensor], moves: Iterable[Move]) -> dict[int, dict]:
    """{destination rank: bundle} of the blocks of `moves` that leave this process (see the module doc)."""
    entries: dict[int, list] = {}
    for m in moves:
        if not m.in_place:
            if m.key not in tensors:
                raise KeyError(f"the plan sends {m.key} from a rank that does not hold it (its table and its shard "
                               "disagree: AdamW state before any update?)")
            entries.setdefault(m.dst, []).append((m.key, m.box.b_at, _block(tensors[m.key], m.box.a_at, m.box.size)))
    return {dst: pack(e) for dst, e in entries.items()}


def pack(entries: list[tuple[str, tuple[int, ...], torch.Tensor]]) -> dict:
    """(key, where it goes, block) entries as one flat byte buffer and their table."""
    table, flat = [], []
    for key, at, t in entries:
        t = t.detach().contiguous().cpu()
        table.append((key, tuple(at), tuple(t.shape), str(t.dtype).removeprefix("torch."), t.nbytes))
        flat.append(t.reshape(-1).view(torch.uint8))
        if t.nbytes % ALIGN:  # the next block starts aligned for any dtype's view
            flat.append(torch.zeros(ALIGN - t.nbytes % ALIGN, dtype=torch.uint8))
    data = torch.cat(flat).numpy() if flat else np.empty(0, dtype=np.uint8)
    return {"blocks": table, "data": data}


def unpack(bundle: dict):
    """(key, where it goes, block) of a bundle; blocks are views of its buffer."""
    data = torch.from_numpy(bundle["data"]) if len(bundle["data"]) else torch.empty(0, dtype=torch.uint8)
    at = 0
    for key, dst_at, shape, dtype, nbytes in bundle["blocks"]:
        yield key, dst_at, data[at:at + nbytes].view(getattr(torch, dtype)).reshape(shape)
        at += -(-nbytes // ALIGN) * ALIGN


def fill(targets: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], moves: Iterable[Move],
         bundles: Iterable[dict], parts: Iterable[tuple[int, Mapping[str, torch.Tensor]]] = ()) -> None:
    """Write this rank's in-place `moves` from `own`, every block of `bundles` and its snapshot moves from
    `parts` into `targets` (see the module doc)."""
    moves = list(moves)
    with torch.no_grad():
        for m in moves:
            if m.in_place:
                _copy(_block(targets[m.key], m.box.b_at, m.box.size), _block(own[m.key], m.box.a_at, m.box.size))
        for bundle in bundles:
            for key, at, block in unpack(bundle):
                _block(targets[key], at, tuple(block.shape)).copy_(block)
        for rank, tensors in parts:
            for m in moves:
                if m.source.kind is SourceKind.SNAPSHOT and m.source.rank == rank:
                    _block(targets[m.key], m.box.b_at, m.box.size).copy_(_block(tensors[m.key], m.box.a_at,
                                                                                 m.box.size))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, unless they are the same memory (a tensor a rank keeps as it is)."""
    if dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride() and dst.dtype == src.dtype:
        return
    dst.copy_(src)
