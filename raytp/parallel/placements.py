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
(``split_axes``). How a split along TP slices the tensor (fused q/k/v blocks,
the padded vocabulary, shared KV heads) is the model's ``Sharding`` row
(raytp.parallel.sharding); this table says which axes split it.

Dense weights split along TP by their Sharding (or replicated there) and
replicated over DP (``dense_weight``); expert weights (Mixture of Experts) split
over EP along the expert dim, over ETP as a dense row would be, replicated over
expert-DP (``expert_placement``). Who holds which bytes of the whole state, AdamW
rows included, is the placement table's (raytp.moves.table, raytp.moves.owners).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

from raytp.parallel.layout import Layout

ROWS = -1  # Shard(ROWS): the flattened rows of a tensor, as the distributed optimizer splits its state


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class Replicate:
    pass


REPLICATE = Replicate()


@dataclass(frozen=True)
class TensorPlacement:
    axes: tuple[tuple[str, Shard | Replicate], ...]

    @classmethod
    def of(cls, **axes: Shard | Replicate) -> "TensorPlacement":
        return cls(tuple(axes.items()))

    def on(self, axis: str) -> Shard | Replicate | None:
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


def dense_weight(split_dim: int | None) -> TensorPlacement:
    """A dense parameter: split along TP on `split_dim` (None: replicated there), replicated over DP."""
    return TensorPlacement.of(tp=REPLICATE if split_dim is None else Shard(split_dim), dp=REPLICATE)


def expert_placement(split_dim: int | None, expert_dim: int = 0) -> TensorPlacement:
    """An expert's weight: its experts split over EP along `expert_dim`, each expert split over ETP on
    `split_dim` (None: whole in each ETP rank), replicated over expert-DP."""
    return TensorPlacement.of(etp=REPLICATE if split_dim is None else Shard(split_dim), ep=Shard(expert_dim),
                              edp=REPLICATE)
