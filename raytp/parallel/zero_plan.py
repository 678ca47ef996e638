"""Which rows of a shard's parameters each data-parallel rank owns under the distributed optimizer.

A pure function of the parameters' shapes (in the model's parameter order,
the order checkpoints list them), the DP degree and a bucket size. The
parameters are grouped into *buckets* of consecutive whole tensors (a tensor
larger than a bucket is a bucket of its own); each bucket's rows (the rows of
its tensors along dim 0, in order; a 1-D tensor's rows are its elements) are
cut into dp consecutive ranges of about equal elements, cut only between
rows. DP rank d owns range d of every bucket: it keeps the AdamW moments of
those rows only, receives their reduced gradients (the bucket laid out flat,
rank after rank, each rank's range padded to the bucket's ``chunk``, is what
the reduce-scatter splits), updates them, and gives them to the others (the
all-gather on the same layout). Because a range is whole rows of whole
tensors, rank d's part of a tensor is a contiguous block of its rows:
``Piece`` names it, and checkpoints store it as such (raytp.files.checkpoint).

Megatron's distributed optimizer cuts its buffers at any element; cutting
between rows costs at most one row of padding per rank and buys state that is
plain tensor rows wherever it goes.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

BUCKET_NUMEL = 40_000_000  # elements per bucket (Megatron's default gradient bucket: 40M)


@dataclass(frozen=True)
class Piece:
    """Rows start..stop of parameter `index`, at element `at` of its owner's chunk of the bucket."""

    index: int
    start: int
    stop: int
    row: int  # elements per row
    at: int

    @property
    def numel(self) -> int:
        return (self.stop - self.start) * self.row


@dataclass(frozen=True)
class Bucket:
    params: tuple[int, ...]                  # parameter indices, in order
    chunk: int                               # elements of each rank's (padded) range
    ranges: tuple[tuple[Piece, ...], ...]    # per DP rank: the pieces it owns, in order

    @property
    def numel(self) -> int:
        """The flat buffer's elements: dp chunks."""
        return self.chunk * len(self.ranges)

    def span(self, d: int, piece: Piece) -> slice:
        """Where DP rank `d`'s `piece` lies in the bucket's flat buffer."""
        at = d * self.chunk + piece.at
        return slice(at, at + piece.numel)


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, elements per row) of a tensor of `shape`: dim 0's rows; a 0-d tensor is one row of one."""
    if not shape:
        return 1, 1
    return shape[0], prod(shape[1:])


def consecutive(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of `sizes`, in order, grouped into runs of at most `limit` in total (a larger one alone): the
    buckets here, and the files of a sharded Hugging Face export (raytp.files.interop.hf)."""
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(sizes):
        if not out or used + n > limit:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def buckets_of(shapes: list[tuple[int, ...]], bucket_numel: int) -> list[list[int]]:
    """Consecutive parameter indices grouped into buckets of at most `bucket_numel` elements (a larger
    tensor alone)."""
    return consecutive([prod(shape) for shape in shapes], bucket_numel)


def cut(shapes: list[tuple[int, ...]], indices: list[int], dp: int) -> Bucket:
    """Bucket `indices` cut into dp ranges between rows: boundary d at the row edge nearest d/dp of the
    bucket's elements."""
    spans = []   # (index, first element offset, rows, row)
    total = 0
    for i in indices:
        rows, row = rows_of(shapes[i])
        spans.append((i, total, rows, row))
        total += rows * row
    cuts = [0]
    for d in range(1, dp):
        target = total * d / dp
        best = cuts[-1]
        for _, off, rows, row in spans:  # the edge nearest the target, at or after the last cut
            if off + rows * row < target:
                continue
            k = min(max(round((target - off) / row), 0), rows) if row else 0
            best = max(off + k * row, cuts[-1])
            break
        cuts.append(best)
    cuts.append(total)
    ranges = []
    for d in range(dp):
        lo, hi = cuts[d], cuts[d + 1]
        pieces, at = [], 0
        for i, off, rows, row in spans:
            a, b = max(lo, off), min(hi, off + rows * row)
            if b > a:
                pieces.append(Piece(i, (a - off) // row, (b - off) // row, row, at))
                at += b - a
        ranges.append(tuple(pieces))
    chunk = max((cuts[d + 1] - cuts[d] for d in range(dp)), default=0)
    return Bucket(tuple(indices), chunk, tuple(ranges))


def plan(shapes: list[tuple[int, ...]], dp: int, bucket_numel: int = BUCKET_NUMEL) -> list[Bucket]:
    """Every bucket of a shard whose parameters have `shapes`, cut for `dp` ranks."""
    return [cut(shapes, idx, dp) for idx in buckets_of(shapes, bucket_numel)]


def owned_rows(buckets: list[Bucket], dp_rank: int) -> dict[int, tuple[int, int]]:
    """{parameter index: (first row, end row)} that `dp_rank` owns (a rank owns at most one block of a
    tensor, since a tensor lies in one bucket and ranges are consecutive)."""
    return {p.index: (p.start, p.stop) for b in buckets for p in b.ranges[dp_rank]}


def handover(shapes: list[tuple[int, ...]], old_dp: int, old_rank: int, new_dp: int,
             bucket_numel: int = BUCKET_NUMEL) -> list[dict[int, tuple[int, int]]]:
    """A DP resize's re-cut: for each DP rank of `new_dp`, {parameter index: (first row, end row)} of the rows
    that rank owns at `new_dp` and DP rank `old_rank` owns at `old_dp` (what old_rank hands it). Over every
    old rank the blocks a new rank receives are exactly its rows, each row from one old rank."""
    mine = owned_rows(plan(shapes, old_dp, bucket_numel), old_rank)
    new = plan(shapes, new_dp, bucket_numel)
    out = []
    for d in range(new_dp):
        got = {}
        for i, (c, e) in owned_rows(new, d).items():
            a, b = mine.get(i, (0, 0))
            lo, hi = max(a, c), min(b, e)
            if hi > lo:
                got[i] = (lo, hi)
        out.append(got)
    return out
