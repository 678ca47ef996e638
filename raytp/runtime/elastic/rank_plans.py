"""Which workers a layout change keeps, and which start (and when), as pure functions of the two layouts.

A worker's actor name carries its rank (raytp.names.worker) and Ray cannot rename an actor, so a process
is kept only where its rank number, coordinates and bundle are the same at both layouts; the others start
anew: *early* (while the old layout trains on) where the name is free and no old worker holds the
bundle, *late* (once the old holder is gone) otherwise. No Ray, no processes (tests/test_policy.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from raytp.parallel.layout import Layout


@dataclass(frozen=True)
class RankPlan:
    """Which workers of a resize keep their processes, and which start (and when)."""
    kept: tuple[int, ...]                # same rank, name and bundle at both layouts
    early: tuple[int, ...]               # new ranks whose names are free: started while the old layout trains
    late: tuple[int, ...]                # new ranks whose names are taken: started once the old holder is gone
    removed: tuple[int, ...]             # old ranks that stop


def dp_resize_ranks(replica_size: int, old_dp: int, new_dp: int) -> RankPlan:
    """A DP change keeps the staying replicas' workers (`replica_size` ranks each: tp x pp); added
    replicas' ranks are new numbers."""
    n = replica_size
    keep = min(old_dp, new_dp) * n
    return RankPlan(tuple(range(keep)), tuple(range(old_dp * n, new_dp * n)), (),
                    tuple(range(new_dp * n, old_dp * n)))


def tp_resize_ranks(old: Layout, new: Layout) -> RankPlan:
    """A TP change keeps replica 0's first min(old, new) TP ranks (the only ranks whose number,
    replica and bundle are the same at both layouts); every other rank starts anew. Early, while the
    old layout trains on: those whose name is free and whose bundle no old worker holds (a staying
    replica's bundle TP index i < old.tp is old rank i's of that replica until the switch: placement
    reserve_tp keeps a replica's old bundles first); the others once the old workers are gone."""
    keep = min(old.tp, new.tp)

    def free(r: int) -> bool:
        at = new.coords(r)
        return r >= old.world_size and (at.dp >= old.dp or at.tp >= old.tp)

    starting = range(keep, new.world_size)
    return RankPlan(tuple(range(keep)), tuple(r for r in starting if free(r)),
                    tuple(r for r in starting if not free(r)), tuple(range(keep, old.world_size)))


def stage_resize_ranks(old: Layout, new: Layout) -> RankPlan:
    """A change of the stages at the same TP degree keeps the processes of the ranks whose number, TP
    rank, stage and replica are the same at both layouts (replica 0's stages present at both: their
    placement groups stay, raytp.runtime.cluster.placement.reserve_stages); every other rank starts
    anew, early where its name is free and its bundle is not an old worker's (an old stage group)."""
    kept = tuple(r for r in range(min(old.world_size, new.world_size)) if old.coords(r) == new.coords(r))

    def free(r: int) -> bool:
        at = new.coords(r)
        return r >= old.world_size and not (at.dp < old.dp and at.pp < old.pp)

    starting = [r for r in range(new.world_size) if r not in kept]
    return RankPlan(kept, tuple(r for r in starting if free(r)), tuple(r for r in starting if not free(r)),
                    tuple(r for r in range(old.world_size) if r not in kept))


def restage_ranks(old: Layout, new: Layout) -> RankPlan:
    """A change that starts every worker of the new layout anew, ahead, beside the running one (a TP change
    at pp > 1): no process is kept; a name still held goes to the new worker as names.worker_ahead."""
    return RankPlan((), tuple(range(new.world_size)), (), tuple(range(old.world_size)))


def ep_resize_ranks(old: Layout) -> RankPlan:
    """An expert-parallel change (the same TP, PP and DP) keeps every worker: only the experts move."""
    return RankPlan(tuple(range(old.world_size)), (), (), ())
