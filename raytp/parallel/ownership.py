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
on a mesh of their own (ep > 1, or etp 1 at tp > 1) are held by their expert-DP
group only: they narrow the holders to the ranks holding the same dense bytes
and the same experts, and every first of those owns a part (under zero 1 their
AdamW state is cut over expert-DP too: every rank owns a part anyway).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from raytp.parallel.layout import Layout
from raytp.parallel.placements import (TensorPlacement, dense_state_placements, dense_weight_placements,
                                      expert_placement, expert_state)


@dataclass(frozen=True)
class Ownership:
    layout: Layout
    weights: tuple[TensorPlacement, ...] | None = None  # the weights' distinct placements; None: a dense model's
    state: tuple[TensorPlacement, ...] | None = None    # those of the optimizer's state; None: a dense model's

    @property
    def table(self) -> tuple[TensorPlacement, ...]:
        """Every distinct placement of the state, weights first."""
        return _rule(self.layout, self.weights, self.state).table

    @property
    def parts(self) -> int:
        """How many distinct parts the state is in (one per owner)."""
        return len(_rule(self.layout, self.weights, self.state).owners)

    def owners(self) -> list[int]:
        """The ranks that own the state, part 0 first: together they hold all of it."""
        return list(_rule(self.layout, self.weights, self.state).owners)

    def owns(self, rank: int) -> bool:
        return self.holders(rank)[0] == rank

    def part(self, rank: int) -> int:
        """Which part of the state `rank` holds (the same for every rank holding the same bytes)."""
        rule = _rule(self.layout, self.weights, self.state)
        return rule.part_of[rule.holders[self._checked(rank)][0]]

    def owner(self, part: int) -> int:
        return _rule(self.layout, self.weights, self.state).owners[part]

    def writes_weights(self, rank: int) -> bool:
        """Whether `rank` writes its weights into checkpoints: it is the first of the ranks holding the same
        weights as it (replica 0's ranks for a dense model)."""
        return self.weight_holders(rank)[0] == rank

    def weight_holders(self, rank: int) -> list[int]:
        """Every rank holding the same weights as `rank` (itself included), ascending."""
        return list(_rule(self.layout, self.weights, self.state).weight_holders[self._checked(rank)])

    def holders(self, rank: int) -> list[int]:
        """Every rank holding the same bytes as `rank` (itself included), ascending: its DP group for a
        dense model, or itself alone under zero 1."""
        return list(_rule(self.layout, self.weights, self.state).holders[self._checked(rank)])

    def first_holders(self) -> tuple[int, ...]:
        """For every rank, the first of its holders (ranks with the same first hold the same bytes)."""
        return tuple(h[0] for h in _rule(self.layout, self.weights, self.state).holders)

    def _checked(self, rank: int) -> int:
        if not 0 <= rank < self.layout.world_size:
            raise ValueError(f"rank {rank} outside world of {self.layout.world_size} ({self.layout})")
        return rank


@dataclass(frozen=True)
class _Rule:
    """The ownership rule of one (layout, placements), worked out once for every rank."""
    table: tuple[TensorPlacement, ...]
    holders: tuple[tuple[int, ...], ...]          # rank -> the ranks holding the same state
    weight_holders: tuple[tuple[int, ...], ...]   # rank -> the ranks holding the same weights
    owners: tuple[int, ...]
    part_of: dict


def _same(layout: Layout, table: tuple[TensorPlacement, ...]) -> tuple[tuple[int, ...], ...]:
    """For every rank, the ranks that hold the same bytes of every placement in `table`: those in the same
    sub-mesh of each placement's replicated axes (one pass over the ranks per placement)."""
    keys = [() for _ in range(layout.world_size)]
    for p in table:
        axes = [a for a in p.replicated_axes if layout.degree(a) > 1]
        if not axes:
            return tuple((r,) for r in range(layout.world_size))
        for g, members in enumerate(layout.groups(axes)):
            for r in members:
                keys[r] += (g,)
    by_key: dict[tuple, list[int]] = {}
    for r, k in enumerate(keys):
        by_key.setdefault(k, []).append(r)
    return tuple(tuple(by_key[keys[r]]) for r in range(layout.world_size))


def expert_placement_of(layout: Layout) -> TensorPlacement:
    """Where a routed expert's tensors live on `layout` (split over ETP, or whole, on each EP rank)."""
    return expert_placement(0 if layout.expert_tp > 1 else None)


def _experts(layout: Layout) -> tuple[TensorPlacement, ...]:
    """A model's expert placement where its layout gives experts a mesh of their own."""
    return (expert_placement_of(layout),) if layout.experts_split else ()


def _expert_state(layout: Layout) -> tuple[TensorPlacement, ...]:
    """Where the experts' AdamW state lives: as their weights, or cut over expert-DP by rows under zero 1."""
    if not layout.experts_split:
        return ()
    return (expert_state(0 if layout.expert_tp > 1 else None, layout),)


@lru_cache(maxsize=64)
def _rule(layout: Layout, weights, state) -> _Rule:
    weights = weights if weights is not None else dense_weight_placements() + _experts(layout)
    state = state if state is not None else dense_state_placements(layout) + _expert_state(layout)
    table = tuple(dict.fromkeys(weights + state))
    holders = _same(layout, table)
    owners = tuple(r for r in range(layout.world_size) if holders[r][0] == r)
    return _Rule(table, holders, _same(layout, weights), owners, {r: i for i, r in enumerate(owners)})
