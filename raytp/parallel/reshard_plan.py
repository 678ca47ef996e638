"""The reshard plan: which slice of which old rank's shard goes where in a new rank's shard. Pure.

A sharded tensor (raytp.parallel.sharding) is split along one dim; each rank
holds some ranges of positions there (``shard_ranges``). Moving from TP degree
``old_tp`` to ``new_tp``, new rank j's shard is a list of ``Piece``s: rows
[src_at, src_at + length) of old rank ``src``'s local tensor (along the split
dim) land at rows [dst_at, dst_at + length) of j's. Positions that are padding
at the new layout (past the vocabulary) come from nowhere and stay zero;
padding at the old layout is never read. A replicated tensor is one piece of
old rank 0, whole; a KV head that several old ranks share comes from its owner. The same plan serves a resume at another layout (pieces are
byte ranges of the saved files), a live TP resize (pieces travel from the old
ranks to the new) and an export (new_tp = 1).
"""
from __future__ import annotations

from dataclasses import dataclass

from raytp.parallel.placements import Split
from raytp.parallel.sharding import shard_ranges


@dataclass(frozen=True)
class Piece:
    src: int        # the old TP rank holding it
    src_at: int     # where it starts in that rank's local tensor, along the split dim
    dst_at: int     # where it goes in the new rank's local tensor
    length: int


def _spans(s: Split, size: int, rank: int, tp: int) -> list[tuple[int, int, int]]:
    """(global start, global stop, local start) of each range rank `rank` holds, real positions only."""
    out, at = [], 0
    for r in shard_ranges(s, size, rank, tp):
        stop = min(r.stop, size)
        if stop > r.start:
            out.append((r.start, stop, at))
        at += len(r)
    return out


def pieces(s: Split, size: int, old_tp: int, new_tp: int, dst: int) -> list[Piece]:
    """The pieces of new TP rank `dst`'s shard of a tensor `size` long along s.dim (see the module doc)."""
    if s.dim is None:
        return [Piece(0, 0, 0, size)]
    old = [(i, span) for i in range(old_tp) if s.owns(i, old_tp) for span in _spans(s, size, i, old_tp)]
    out = []
    for lo, hi, dst_local in _spans(s, size, dst, new_tp):
        for i, (olo, ohi, src_local) in old:
            a, b = max(lo, olo), min(hi, ohi)
            if a < b:
                out.append(Piece(i, src_local + (a - olo), dst_local + (a - lo), b - a))
    return sorted(out, key=lambda p: p.dst_at)


def moved_rows(s: Split, size: int, old_tp: int, new_tp: int, kept: bool) -> int:
    """Rows (along s.dim) that change owner when going from old_tp to new_tp: those whose new holder is
    not the process that held them (new rank j is old rank j's process when `kept`)."""
    total = 0
    for j in range(new_tp):
        for p in pieces(s, size, old_tp, new_tp, j):
            if not (kept and p.src == j):
                total += p.length
    return total
