"""In-memory snapshots: the newest state of every shard, in the Ray object store.

Workers yield a copy of their shard state every `recovery.snapshot_every`
steps from their streaming step call; an object yielded that way is owned by
the caller, the driver, so it outlives the worker that made it (not the node
whose object store holds it: a node loss is covered by DP replicas on other
nodes, or by checkpoints). Only DP replica 0 snapshots, as the other replicas
hold the same shards. A snapshot is usable once every TP rank's part of the
same step has arrived.
"""
from __future__ import annotations


class Snapshots:
    def __init__(self, tp: int):
        self.tp = tp
        self.by_step: dict[int, list] = {}

    def add(self, step: int, tp_rank: int, ref) -> None:
        """The state of TP rank `tp_rank` after `step` completed steps."""
        self.by_step.setdefault(step, [None] * self.tp)[tp_rank] = ref
        newest = self.latest()
        if newest is not None:  # older snapshots are never needed again: free them
            for s in [s for s in self.by_step if s < newest[0]]:
                del self.by_step[s]

    def latest(self) -> tuple[int, list] | None:
        """(step, [ref per TP rank]) of the newest complete snapshot, if any."""
        complete = [s for s, refs in self.by_step.items() if all(r is not None for r in refs)]
        return (max(complete), self.by_step[max(complete)]) if complete else None
