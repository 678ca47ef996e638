"""Who owns which bytes of the training state: one rule, asked by everything that moves state.

Snapshots (which ranks pack theirs), checkpoint writes (which ranks write a
file), restores (which live rank can give a lost one its state), resizes
(whose shards are cut for the new layout) and exports all ask here, so a
change of what a rank holds is a change of this file.

The rule today: parameters are split over TP within a stage, every DP replica
holds a whole copy of them and of the AdamW state (the optimizer is
replicated). So replica 0's ranks are the *owners*: together they hold the
whole state once, each its ``part`` (its TP rank, within its stage); and every
rank of the same (tp, pp) coordinates in another replica *holds* the same bytes
and can stand in for it. A pipeline (stages own their layers: ``part`` counts
stages too) and a DP-sharded optimizer (each DP rank owns 1/dp of the
optimizer state, which no other replica holds) change this rule.
"""
from __future__ import annotations

from dataclasses import dataclass

from raytp.parallel.layout import Layout


@dataclass(frozen=True)
class Ownership:
    layout: Layout

    @property
    def parts(self) -> int:
        """How many distinct parts the state is in (one per owner)."""
        return self.layout.replica_size

    def owners(self) -> list[int]:
        """The ranks that own the state, part 0 first: together they hold all of it, once."""
        return self.layout.replica(0)

    def owns(self, rank: int) -> bool:
        return self.layout.coords(rank).dp == 0

    def part(self, rank: int) -> int:
        """Which part of the state `rank` holds (the same for every rank holding the same bytes)."""
        c = self.layout.coords(rank)
        return c.pp * self.layout.tp + c.tp

    def owner(self, part: int) -> int:
        return self.owners()[part]

    def holders(self, rank: int) -> list[int]:
        """Every rank holding the same bytes as `rank` (itself included): its DP group."""
        c = self.layout.coords(rank)
        return self.layout.dp_group(c.tp, c.pp)
