"""Who owns which bytes of the training state: one rule, read from the placement table, asked by everything
that moves state.

Snapshots (which ranks pack theirs), checkpoint writes (which ranks write a
file), restores (which live rank can give a lost one its state), resizes
(whose shards are cut for the new layout) and exports all ask here, so a
change of what a rank holds is a change of the placements (raytp.parallel.placements).

A rank's state is every tensor it holds. Another rank holds the *same* state
only if it holds the same bytes of every one of them: ``holders(rank)`` is the
intersection, over the state's distinct placements, of the ranks along each
placement's replicated axes. The first of a rank's holders is an *owner*; the
owners together hold the whole state once, each its ``part``. For a dense model
with the replicated optimizer (``zero`` 0) that is replica 0's ranks, and the
same (tp, pp) coordinates in every other replica can stand in for them; with
the distributed optimizer (``zero`` 1, dp > 1) each DP rank keeps the AdamW
state of its own rows, so every rank owns a part and none can stand in for
another (a lost rank's state comes from a snapshot or a checkpoint). Experts
replicated over expert-DP only narrow the holders the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from raytp.parallel.layout import Layout
from raytp.parallel.placements import TensorPlacement, dense_state_placements, dense_weight_placements


@dataclass(frozen=True)
class Ownership:
    layout: Layout
    weights: tuple[TensorPlacement, ...] | None = None  # the weights' distinct placements; None: a dense model's
    state: tuple[TensorPlacement, ...] | None = None    # those of the optimizer's state; None: a dense model's

    @property
    def table(self) -> tuple[TensorPlacement, ...]:
        """Every distinct placement of the state, weights first."""
        return tuple(dict.fromkeys(self._weights + (self.state if self.state is not None
                                                    else dense_state_placements(self.layout))))

    @property
    def _weights(self) -> tuple[TensorPlacement, ...]:
        return self.weights if self.weights is not None else dense_weight_placements()

    @property
    def parts(self) -> int:
        """How many distinct parts the state is in (one per owner)."""
        return len(self.owners())

    def owners(self) -> list[int]:
        """The ranks that own the state, part 0 first: together they hold all of it."""
        return list(_owners(self.layout, self.table)[0])

    def owns(self, rank: int) -> bool:
        return self.holders(rank)[0] == rank

    def part(self, rank: int) -> int:
        """Which part of the state `rank` holds (the same for every rank holding the same bytes)."""
        return _owners(self.layout, self.table)[1][self.holders(rank)[0]]

    def owner(self, part: int) -> int:
        return self.owners()[part]

    def writes_weights(self, rank: int) -> bool:
        """Whether `rank` writes its weights into checkpoints: it is the first of the ranks holding the same
        weights as it (replica 0's ranks for a dense model)."""
        return self.weight_holders(rank)[0] == rank

    def weight_holders(self, rank: int) -> list[int]:
        """Every rank holding the same weights as `rank` (itself included), ascending."""
        return list(_holders(self.layout, self._weights, rank))

    def holders(self, rank: int) -> list[int]:
        """Every rank holding the same bytes as `rank` (itself included), ascending: its DP group for a
        dense model, or itself alone under zero 1."""
        return list(_holders(self.layout, self.table, rank))


@lru_cache(maxsize=4096)
def _holders(layout: Layout, table: tuple[TensorPlacement, ...], rank: int) -> tuple[int, ...]:
    held = None
    for p in table:
        mine = set(p.holders(layout, rank))
        held = mine if held is None else held & mine
    return tuple(sorted(held)) if held else (rank,)


@lru_cache(maxsize=64)
def _owners(layout: Layout, table: tuple[TensorPlacement, ...]) -> tuple[tuple[int, ...], dict[int, int]]:
    owners = tuple(r for r in range(layout.world_size) if _holders(layout, table, r)[0] == r)
    return owners, {r: i for i, r in enumerate(owners)}
