"""The kinds of layout change a running job makes: each a plan that reserves its own placement and switches.

``plan_change(old, new)`` picks the plan (which ranks it keeps and starts: raytp.runtime.elastic.rank_plans);
raytp.runtime.elastic.resize.Elastic carries any plan out the same way: ``reserve`` the new layout's
placement beside the job, start the plan's early ranks there while the old layout trains on, ``switch`` at
a step boundary (the state mover's plan, carried out by raytp.runtime.elastic.reshard.switch, or
raytp.runtime.elastic.replicas for a DP change), adopt or roll back.

- ``DpChange``: replicas added or removed; the staying ones keep their processes.
- ``TpChange``: TP at pp == 1; replica 0's first TP ranks keep theirs (placement grows replicas in place).
- ``StageChange``: the pipeline degree at the same TP; stages present at both layouts keep theirs.
- ``Restage``: TP at pp > 1 (or to or from it), or any change where a stage holds more ranks than its TP
  ranks (``Layout.stage_ranks``: context parallelism's) before or after, or a TP grow whose extension bundles
  landed off their replica's node: every worker of the new layout starts anew, ahead, in placement of its own
  (one whose rank's name a running worker holds is named ``names.worker_ahead``); the old placement goes.
- ``EpChange``: the expert-parallel degree alone; every worker keeps its process, the experts move.
- ``InBundles``: no room beside the job, and the new layout fits in the bundles it holds (``slots.carve``):
  nothing is reserved or started ahead; where every new rank's bundle holds an old worker (one stage each
  side), that process takes the rank and reshapes, else every new rank starts there once the old ones stop
  (a longer pause, nothing lost).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raytp.parallel.layout import Layout
from raytp.runtime.cluster.launch import actor_id, bundle_key
from raytp.runtime.cluster.slots import bundle_of, carve, unused_groups
from raytp.runtime.elastic import rank_plans, replicas, reshard
from raytp.runtime.elastic.rank_plans import RankPlan


@dataclass(frozen=True)
class Reservation:
    """What a plan reserved: the new layout's placement (dp_rank -> placement group), what its switch is
    handed, and the groups asked for (released if the change is dropped)."""
    pgs: dict
    reserved: Any
    requested: list


@dataclass(frozen=True)
class Change:
    ranks: RankPlan
    restarts_all = False  # every worker starts anew, ahead (its names: raytp.names.worker_ahead)

    def bundles(self, old: Layout, new: Layout, held) -> list[int]:
        """The groups ``reserve`` asks for, as their bundle counts (each group packed on one node; `held(q)`:
        the bundles replica q holds now): what the cluster must have free for the change to start beside
        the job."""
        raise NotImplementedError

    def reserve(self, group, new_cfg) -> Reservation | None:
        """The new layout's placement, waited for (PlacementError if it cannot be had); None where the
        plan cannot keep its processes there (the caller then restarts every worker)."""
        raise NotImplementedError

    def switch(self, group, pending, step: int):
        """Switch `group` to the pending layout: (new group, bytes moved); SwitchFailed rolls back. By default
        the processes of `ranks.kept` reshape, the early ranks were started ahead, the late ones start once
        the old ranks in their way stop (raytp.runtime.elastic.reshard.switch); `pending.reserved`: the
        placement as reserve_tp or reserve_stages give it (new placement, requested, unused)."""
        old, new = group.layout, pending.new_cfg.layout
        new_pgs, requested, unused = pending.reserved
        kept = {r: r for r in self.ranks.kept}
        try:
            nxt, moved = reshard.switch(group, pending.new_cfg, step, new_pgs, kept, pending.early, self.ranks.late)
        except reshard.SwitchFailed:
            group.placer.release(requested)
            raise
        group.placer.release(list(unused) + unused_groups([group.pgs[q] for q in range(new.dp, old.dp)],
                                                          nxt.pgs.values()))
        return nxt, moved


@dataclass(frozen=True)
class DpChange(Change):
    def bundles(self, old: Layout, new: Layout, held) -> list[int]:
        return [new.tp] * (new.pp * max(new.dp - old.dp, 0))

    def reserve(self, group, new_cfg) -> Reservation:
        old, dp = group.layout, new_cfg.parallel.dp
        added = list(range(old.dp, dp))
        reserved = group.reserve(new_cfg, group.launcher.run, added,
                                 avoid_nodes=group.placer.nodes_of(group.pgs)) if added else {}
        pgs = {**{q: pg for q, pg in group.pgs.items() if q < dp}, **reserved}
        return Reservation(pgs, reserved, list(reserved.values()))

    def switch(self, group, pending, step: int):
        old, new = group.layout, pending.new_cfg.layout
        return replicas.change_dp(group, pending.new_cfg, replicas.kept_first(old.dp, new.dp), step,
                                  pending.reserved, pending.early)


@dataclass(frozen=True)
class TpChange(Change):
    def bundles(self, old: Layout, new: Layout, held) -> list[int]:
        grown = [new.tp - held(q) for q in range(min(old.dp, new.dp)) if held(q) < new.tp]  # extensions
        return grown + [new.tp] * max(new.dp - old.dp, 0)

    def reserve(self, group, new_cfg) -> Reservation | None:
        reserved = group.placer.reserve_tp(new_cfg, group.launcher.run, group.pgs, group.layout.dp)
        return None if reserved is None else Reservation(reserved[0], reserved, reserved[1])



@dataclass(frozen=True)
class StageChange(Change):
    def bundles(self, old: Layout, new: Layout, held) -> list[int]:
        return [new.tp] * (new.dp * max(new.pp - old.pp, 0))

    def reserve(self, group, new_cfg) -> Reservation:
        old = group.layout
        reserved = group.placer.reserve_stages(new_cfg, group.launcher.run, group.pgs, old.dp, old.pp)
        return Reservation(reserved[0], reserved, reserved[1])



@dataclass(frozen=True)
class Restage(Change):
    restarts_all = True

    def bundles(self, old: Layout, new: Layout, held) -> list[int]:
        return [new.stage_ranks] * (new.dp * new.pp)

    def reserve(self, group, new_cfg) -> Reservation:
        pgs = group.reserve(new_cfg, group.launcher.run, list(range(new_cfg.parallel.dp)))
        return Reservation(pgs, pgs, list(pgs.values()))

    def switch(self, group, pending, step: int):
        """Every worker of the new layout was started ahead in its own placement: the state moves worker to
        worker (no process kept), and the old placement goes; a failure rolls back to the old workers."""
        try:
            nxt, moved = reshard.switch(group, pending.new_cfg, step, pending.reserved, {}, pending.early)
        except reshard.SwitchFailed:
            group.kill_actors(a for a, _ in pending.early.values())
            group.placer.release(pending.requested)
            raise
        group.placer.release(group.pgs.values())
        return nxt, moved


@dataclass(frozen=True)
class EpChange(Change):
    def bundles(self, old: Layout, new: Layout, held) -> list[int]:
        return []  # every worker stays where it is

    def reserve(self, group, new_cfg) -> Reservation:
        return Reservation(dict(group.pgs), None, [])

    def switch(self, group, pending, step: int):
        """Every process kept: each rank rebuilds its shard from its old one and the experts (and, under zero 1,
        their AdamW rows, cut again over the new expert-DP) the plan sends it, from a holder on its node where
        there is one."""
        everyone = {r: r for r in range(group.layout.world_size)}
        return reshard.switch(group, pending.new_cfg, step, group.pgs, everyone, {})


@dataclass(frozen=True)
class InBundles(Change):
    """The new layout inside the bundles the job holds (``carve``d from them): ``ranks.kept`` are the new ranks
    whose bundle an old worker sits in (``holders``: {new rank: that old rank}) where every new rank's does,
    else every new rank is late."""
    holders: tuple[tuple[int, int], ...] = ()
    carved: dict = field(default_factory=dict, compare=False)  # dp_rank -> the Slots carved for it

    @classmethod
    def of(cls, group, new: Layout) -> "InBundles | None":
        """The plan for `group` at `new` inside its own bundles; None where they cannot hold it."""
        carved = carve(group.pgs, new.tp, new.dp)
        if carved is None:
            return None
        old, holders = group.layout, _holders(group, new, carved) or {}
        late = () if holders else tuple(range(new.world_size))
        return cls(rank_plans.RankPlan(tuple(sorted(holders)), (), late, tuple(range(old.world_size))),
                   tuple(sorted(holders.items())), carved)

    def bundles(self, old: Layout, new: Layout, held) -> list[int]:
        return []  # nothing asked for

    def reserve(self, group, new_cfg) -> Reservation:
        return Reservation(self.carved, self.carved, [])

    def switch(self, group, pending, step: int):
        return reshard.switch(group, pending.new_cfg, step, pending.reserved, dict(self.holders), {}, self.ranks.late)


def _holders(group, new: Layout, new_pgs: dict) -> dict | None:
    """{new rank: the old rank sitting in the bundle the rank takes} where every new rank's bundle is an old
    worker's (one stage each side), else None."""
    if new.pp > 1 or group.layout.pp > 1:
        return None
    by_bundle = {group.bundles.get(actor_id(w)): r for r, w in enumerate(group.workers)}
    out = {}
    for r in range(new.world_size):
        pg, index = bundle_of(new_pgs[new.coords(r).dp], new.bundle_index(r))
        out[r] = by_bundle.get(bundle_key(pg, index))
        if out[r] is None:
            return None
    return out


def plan_change(old: Layout, new: Layout) -> Change:
    """The plan that takes a running job from `old` to `new` (which differ)."""
    ep_only = (new.tp, new.pp, new.dp, new.expert_tp) == (old.tp, old.pp, old.dp, old.expert_tp)
    rows_alike = not old.sharded_optimizer or (old.experts_split and new.experts_split)  # zero 1's dense rows
    if new.ep != old.ep and ep_only and rows_alike:
        return EpChange(rank_plans.ep_resize_ranks(old))
    beside_tp = old.stage_ranks != old.tp or new.stage_ranks != new.tp  # a stage holds more than its TP ranks
    # Experts on a mesh of their own: a DP change keeps processes (the replicas' expert slices follow their DP
    # rank; zero 1 re-cuts their rows over the new expert-DP in place), no other does.
    dp_only = (new.tp, new.pp, new.ep, new.expert_tp) == (old.tp, old.pp, old.ep, old.expert_tp)
    experts = (old.experts_split or new.experts_split) and not dp_only
    if beside_tp or experts or (new.tp != old.tp and (new.pp > 1 or old.pp > 1)):
        return Restage(rank_plans.restage_ranks(old, new))
    if new.pp != old.pp:
        return StageChange(rank_plans.stage_resize_ranks(old, new))
    if new.tp == old.tp:
        return DpChange(rank_plans.dp_resize_ranks(old.replica_size, old.dp, new.dp))
    return TpChange(rank_plans.tp_resize_ranks(old, new))
