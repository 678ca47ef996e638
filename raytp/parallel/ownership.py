"""Who owns which bytes of the training state: one rule, asked by everything that moves state.

Snapshots (which ranks pack theirs), checkpoint writes (which ranks write a
file), restores (which live rank can give a lost one its state), resizes
(whose shards are cut for the new layout) and exports all ask here, so a
change of what a rank holds is a change of this file.

The rule: parameters are split over TP within a stage (``part`` counts
stages too), and every DP replica holds a whole copy of its shard's weights.
With the replicated optimizer (``zero`` 0) it holds the AdamW state too, so
replica 0's ranks are the *owners*: together they hold the whole state once,
each its ``part``; and every rank of the same (tp, pp) coordinates in another
replica *holds* the same bytes and can stand in for it. With the distributed
optimizer (``zero`` 1, dp > 1) each DP rank keeps the AdamW state of its own
rows (raytp.parallel.zero_plan), which no other rank holds: every rank is an
owner of a part of its own (its weights and its rows' state), and no rank
can stand in for another (a lost rank's state comes from a snapshot or a
checkpoint).
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
        return self.layout.world_size if self.layout.sharded_optimizer else self.layout.replica_size

    def owners(self) -> list[int]:
        """The ranks that own the state, part 0 first: together they hold all of it (the weights once per
        replica under zero 1)."""
        if self.layout.sharded_optimizer:
            return list(range(self.layout.world_size))
        return self.layout.replica(0)

    def owns(self, rank: int) -> bool:
        return self.layout.sharded_optimizer or self.layout.coords(rank).dp == 0

    def part(self, rank: int) -> int:
        """Which part of the state `rank` holds (the same for every rank holding the same bytes)."""
        if self.layout.sharded_optimizer:
            return rank
        c = self.layout.coords(rank)
        return c.pp * self.layout.tp + c.tp

    def owner(self, part: int) -> int:
        return self.owners()[part]

    def writes_weights(self, rank: int) -> bool:
        """Whether `rank` writes its weights into checkpoints (replica 0's ranks: the others' are the same)."""
        return self.layout.coords(rank).dp == 0

    def holders(self, rank: int) -> list[int]:
        """Every rank holding the same bytes as `rank` (itself included): its DP group, or itself alone
        under zero 1."""
        if self.layout.sharded_optimizer:
            return [rank]
        c = self.layout.coords(rank)
        return self.layout.dp_group(c.tp, c.pp)
