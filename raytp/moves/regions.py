"""Which elements of a tensor a rank holds, and where they sit in its local tensor. Pure arithmetic.

A ``Region`` is, for each dim of a tensor, the global intervals a rank holds along
it, in the order they sit in the rank's local tensor: one interval for a plain TP
slice, one per block for fused q/k/v, the whole dim where the tensor is not split
along it. The elements held are the product of those intervals over the dims (every
split in raytp is a product: TP along one dim, the distributed optimizer's rows
along dim 0 of the local tensor). A 0-d tensor (AdamW's step count) has no dims:
its region is the one element.

``overlap(a, b)`` is what two regions share, as boxes: each a contiguous block in
both local tensors (its start in a's, its start in b's, its size).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import product
from math import prod

Intervals = tuple[tuple[int, int], ...]  # global [start, stop) intervals, in local order


@dataclass(frozen=True)
class Box:
    """A block of elements: at `a_at` in one local tensor, at `b_at` in another, `size` along each dim."""
    a_at: tuple[int, ...]
    b_at: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.size)


@dataclass(frozen=True)
class Region:
    dims: tuple[Intervals, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> "Region":
        return cls(tuple(((0, n),) if n else () for n in shape))

    @cached_property
    def shape(self) -> tuple[int, ...]:
        """The local tensor's shape."""
        return tuple(sum(b - a for a, b in d) for d in self.dims)

    @cached_property
    def numel(self) -> int:
        return prod(self.shape)

    def split(self, dim: int, intervals: Intervals) -> "Region":
        """Only the global positions `intervals` (in their order) along `dim`, where this region is whole."""
        return Region(self.dims[:dim] + (tuple(intervals),) + self.dims[dim + 1:])

    def rows(self, start: int, stop: int) -> "Region":
        """Local rows start..stop along dim 0 (the distributed optimizer's cut of a local tensor)."""
        if not self.dims:
            return self
        out, at = [], 0
        for a, b in self.dims[0]:
            lo, hi = max(a, a + start - at), min(b, a + stop - at)
            if hi > lo:
                out.append((lo, hi))
            at += b - a
        return Region((tuple(out),) + self.dims[1:])

    def local(self, dim: int) -> list[tuple[int, int, int]]:
        """(global start, global stop, local start) of each interval along `dim`."""
        out, at = [], 0
        for a, b in self.dims[dim]:
            out.append((a, b, at))
            at += b - a
        return out


def overlap_1d(a: list[tuple[int, int, int]], b: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(local start in a, local start in b, length) of each shared piece of two dims' intervals."""
    out = []
    for a0, a1, at in a:
        for b0, b1, bt in b:
            lo, hi = max(a0, b0), min(a1, b1)
            if hi > lo:
                out.append((at + lo - a0, bt + lo - b0, hi - lo))
    return out


def overlap(a: Region, b: Region) -> list[Box]:
    """The elements both regions hold, as boxes contiguous in both local tensors."""
    if len(a.dims) != len(b.dims):
        raise ValueError(f"regions of {len(a.dims)} and {len(b.dims)} dims")
    per_dim = [overlap_1d(a.local(d), b.local(d)) for d in range(len(a.dims))]
    return [Box(tuple(p[0] for p in ps), tuple(p[1] for p in ps), tuple(p[2] for p in ps))
            for ps in product(*per_dim)]


def cells(region: Region, cuts: list[set[int]]) -> list[Region]:
    """`region` cut at the global positions `cuts[d]` along each dim: regions of one interval per dim, each
    inside or outside any region whose interval edges are among the cuts."""
    per_dim = []
    for d, intervals in enumerate(region.dims):
        pieces = []
        for a, b in intervals:
            edges = sorted({a, b} | {c for c in cuts[d] if a < c < b})
            pieces += list(zip(edges, edges[1:]))
        per_dim.append(pieces)
    return [Region(tuple((iv,) for iv in combo)) for combo in product(*per_dim)]


def contains(outer: Region, inner: Region) -> bool:
    """Whether every element of `inner` (a cell: one interval per dim) lies in `outer`."""
    return all(any(a <= lo and hi <= b for a, b in outer.dims[d]) for d, ((lo, hi),) in enumerate(inner.dims))


def touches(a: Region, b: Region) -> bool:
    """Whether the two regions share any element."""
    return all(any(lo < bh and bl < hi for lo, hi in da for bl, bh in db) for da, db in zip(a.dims, b.dims))


def edges(region: Region) -> list[set[int]]:
    """Each dim's interval edges (the cuts that make `region` whole cells)."""
    return [{e for iv in d for e in iv} for d in region.dims]
