"""Where a tensor lives on the mesh: for each mesh axis it spans, split or replicated (DTensor's Shard/Replicate).

A ``TensorPlacement`` names, axis by axis (raytp.parallel.layout.AXES), what a
tensor of the training state does along it: ``Shard(dim)`` (each rank along the
axis holds its slice along tensor dim ``dim``; ``ROWS``: the optimizer's
flattened rows, raytp.parallel.zero_plan) or ``Replicate()`` (every rank along
it holds the same bytes). An axis it does not name it does not span: a
parameter lives on its pipeline stage only, so dense placements never name pp.

From it follow who holds the same bytes as a rank (``holders``: the sub-mesh of
its replicated axes), who writes them once (``writes``: the first of those),
and over which axes the squares of its gradient are summed for the global norm
(``split_axes``).

How TP cuts a tensor (a ``Split``: the model's row, raytp.models.registry.split_of)
is one of these placements too, its detail carried in the ``Shard`` itself as
DTensor's strided shard carries its split: the dim, in how many independent
blocks (``parts``: 3 for fused q, k, v), whether that dim is padded to a multiple
of tp (``pad``: the vocabulary), and how many whole heads it holds (``heads``: the
key/value projections of grouped-query attention, shared by ranks when tp > heads).
``Replicate`` reads the same (dim None, one part, no padding, no heads), so the
arithmetic of raytp.parallel.sharding takes either; ``split_from`` builds one
from a checkpoint manifest's entry.

Dense weights split along TP by their split (or replicated there) and
replicated over DP (``dense_weight``); expert weights (Mixture of Experts) split
over EP along the expert dim, over ETP as a dense row would be, replicated over
expert-DP (``expert_placement``). Who holds which bytes of the whole state, AdamW
rows included, is the placement table's (raytp.moves.table, raytp.moves.owners).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import reduce

from raytp.parallel.layout import Layout

ROWS = -1  # Shard(ROWS): the flattened rows of a tensor, as the distributed optimizer splits its state


@dataclass(frozen=True)
class Shard:
    """Split along `dim`; along TP (a model's row) also as `parts` independent blocks (3 for fused q, k, v),
    padded along dim to a multiple of tp when `pad` is set (the vocabulary)."""

    dim: int
    parts: int = 1
    pad: bool = False
    heads: int = 0  # > 0: the dim is `heads` whole heads (GQA keys/values), shared by ranks when tp > heads

    def holders(self, tp: int) -> int:
        """How many TP ranks hold each position (1 unless KV heads are shared)."""
        return tp // self.heads if self.heads and tp > self.heads else 1

    def owns(self, rank: int, tp: int) -> bool:
        """Whether TP rank `rank` is the owner of what it holds (the first of the ranks sharing it)."""
        return rank % self.holders(tp) == 0

    def full_size(self, local: int, tp: int, vocab_size: int) -> int:
        """The size along dim of a parameter whose shard at TP degree `tp` is `local` long there (a padded
        dim is the vocabulary's)."""
        return vocab_size if self.pad else local * (tp // self.holders(tp))


@dataclass(frozen=True)
class Replicate:
    """Whole on every rank; read as a split, one that cuts nothing (dim None). Its fields are fixed, not
    arguments: every Replicate() is REPLICATE, and it reads (dataclasses.asdict too) as a replicated split."""

    dim: None = field(default=None, init=False, repr=False)
    parts: int = field(default=1, init=False, repr=False)
    pad: bool = field(default=False, init=False, repr=False)
    heads: int = field(default=0, init=False, repr=False)

    def holders(self, tp: int) -> int:
        return 1

    def owns(self, rank: int, tp: int) -> bool:
        return True

    def full_size(self, local: int, tp: int, vocab_size: int) -> int:
        return local


REPLICATE = Replicate()
Split = Shard | Replicate  # how TP cuts a tensor (a model's row): along one dim, or not at all


def split_from(dim: int | None, parts: int = 1, pad: bool = False, heads: int = 0) -> Split:
    """The split a checkpoint manifest's entry names ({"dim", "parts", "pad"[, "heads"]}): dim None is
    replicated."""
    return REPLICATE if dim is None else Shard(dim, parts, pad, heads)


@dataclass(frozen=True)
class TensorPlacement:
    axes: tuple[tuple[str, Split], ...]

    @classmethod
    def of(cls, **axes: Split) -> "TensorPlacement":
        return cls(tuple(axes.items()))

    def on(self, axis: str) -> Split | None:
        """What the tensor does along `axis`; None where it does not span it."""
        return dict(self.axes).get(axis)

    @property
    def split_axes(self) -> tuple[str, ...]:
        return tuple(a for a, p in self.axes if isinstance(p, Shard))

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        return tuple(a for a, p in self.axes if isinstance(p, Replicate))

    def holders(self, layout: Layout, rank: int) -> list[int]:
        """The ranks holding the same bytes of this tensor as `rank` (itself included), ascending."""
        axes = [a for a in self.replicated_axes if layout.degree(a) > 1]
        return layout.group(rank, axes) if axes else [rank]

    def writes(self, layout: Layout, rank: int) -> bool:
        """Whether `rank` is the one of its holders that writes these bytes (the first)."""
        return self.holders(layout, rank)[0] == rank

    def pieces(self, layout: Layout) -> int:
        """Into how many distinct pieces the tensor is cut on `layout`."""
        return reduce(lambda n, a: n * layout.degree(a), self.split_axes, 1)


def dense_weight(split: Split) -> TensorPlacement:
    """A dense parameter: split along TP as its model's row says (REPLICATE: whole there), replicated over DP."""
    return TensorPlacement.of(tp=split, dp=REPLICATE)


def expert_placement(split: Split, expert_dim: int = 0) -> TensorPlacement:
    """An expert's weight: its experts split over EP along `expert_dim`, each expert split over ETP by
    `split` (REPLICATE: whole in each ETP rank), replicated over expert-DP."""
    return TensorPlacement.of(etp=split, ep=Shard(expert_dim), edp=REPLICATE)
