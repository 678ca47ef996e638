"""Who owns which part of the training state on a layout: a view of the placement table (raytp.moves.table).

The table gives every rank the state it holds by its *place* (``place``: its
stage and TP place, its EP and ETP places where experts have a mesh of their
own, its DP and expert-DP places where the optimizer's rows are cut over them);
ranks in the same place hold the same bytes of every tensor. This module reads
that one rule for the questions that move state as a whole:

- ``holders(rank)``: every rank in its place (its DP group for a dense model at
  zero 0; itself alone under zero 1 with dp > 1; the replicas holding its dense
  shards *and* its experts where experts have a mesh of their own);
- the *owners*: the first rank of each place; together they hold the whole
  state once, each its ``part`` (snapshots pack one part per owner, a restore
  names the owner whose part a lost rank's state came from);
- ``writes_weights(rank)``: the first of the ranks holding the same weights (the
  place without its DP cut: replica 0's ranks for a dense model) writes them
  into checkpoints; ``writes_experts(rank)``: the first holding the same experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from raytp.moves.table import places
from raytp.parallel.layout import Layout


@dataclass(frozen=True)
class Owners:
    layout: Layout

    @property
    def parts(self) -> int:
        """How many distinct parts the state is in (one per owner)."""
        return len(_rule(self.layout).owners)

    def owners(self) -> list[int]:
        """The ranks that own the state, part 0 first: together they hold all of it."""
        return list(_rule(self.layout).owners)

    def owns(self, rank: int) -> bool:
        return self.holders(rank)[0] == rank

    def part(self, rank: int) -> int:
        """Which part of the state `rank` holds (the same for every rank holding the same bytes)."""
        rule = _rule(self.layout)
        return rule.part_of[rule.holders[self._checked(rank)][0]]

    def owner(self, part: int) -> int:
        return _rule(self.layout).owners[part]

    def holders(self, rank: int) -> list[int]:
        """Every rank holding the same bytes as `rank` (itself included), ascending."""
        return list(_rule(self.layout).holders[self._checked(rank)])

    def first_holders(self) -> tuple[int, ...]:
        """For every rank, the first of its holders (ranks with the same first hold the same bytes)."""
        return tuple(h[0] for h in _rule(self.layout).holders)

    def weight_holders(self, rank: int) -> list[int]:
        """Every rank holding the same weights as `rank` (itself included), ascending."""
        return list(_rule(self.layout).weight_holders[self._checked(rank)])

    def writes_weights(self, rank: int) -> bool:
        """Whether `rank` writes its weights into checkpoints: the first of the ranks holding the same."""
        return self.weight_holders(rank)[0] == rank

    def writes_experts(self, rank: int) -> bool:
        """Whether `rank` writes its routed experts' weights: the first of the ranks holding the same experts
        (its stage, EP and ETP places where experts have a mesh of their own; as the weights elsewhere)."""
        return _rule(self.layout).expert_writers[self._checked(rank)]

    def _checked(self, rank: int) -> int:
        if not 0 <= rank < self.layout.world_size:
            raise ValueError(f"rank {rank} outside world of {self.layout.world_size} ({self.layout})")
        return rank


@dataclass(frozen=True)
class _Rule:
    """The owners of one layout, worked out once for every rank."""
    holders: tuple[tuple[int, ...], ...]          # rank -> the ranks in its place
    weight_holders: tuple[tuple[int, ...], ...]   # rank -> the ranks holding the same weights
    expert_writers: tuple[bool, ...]              # rank -> whether it writes its experts
    owners: tuple[int, ...]
    part_of: dict


def _grouped(keys: list[tuple]) -> tuple[tuple[int, ...], ...]:
    """For every rank, the ranks with the same key as it, ascending."""
    by_key: dict[tuple, list[int]] = {}
    for r, k in enumerate(keys):
        by_key.setdefault(k, []).append(r)
    return tuple(tuple(by_key[k]) for k in keys)


@lru_cache(maxsize=64)
def _rule(layout: Layout) -> _Rule:
    places_ = places(layout)
    holders = _grouped(list(places_))
    weights = _grouped([p[:4] for p in places_])  # the place without its DP (expert-DP) cut of the rows
    split = layout.experts_split
    experts = _grouped([(p[0], p[2], p[3]) if split else p[:4] for p in places_])
    owners = tuple(r for r in range(layout.world_size) if holders[r][0] == r)
    return _Rule(holders, weights, tuple(experts[r][0] == r for r in range(layout.world_size)), owners,
                 {r: i for i, r in enumerate(owners)})
