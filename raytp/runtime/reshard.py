"""Moving a running job's state to another layout: the switch a resize (or a grow-back) carries out.

Each function takes the group at the old layout and returns the group at the
new one with every rank holding its shard, and the bytes that moved; or raises
``SwitchFailed`` carrying the group to go on with (the old layout, rolled back).

- DP change (``switch_dp``): the staying replicas' workers keep their processes
  and shards; removed replicas stop and their placement is released; added
  replicas (started ahead, or now) copy their shards from replica 0, worker to
  worker through the object store.
- TP change (``switch_tp``): replica 0's shards are joined into the one-device
  state (in the object store); replica 0's first min(old, new) TP ranks keep
  their processes and reshape in place, every other rank starts anew, and
  every worker builds its shard empty (no seeded initialisation) and takes its
  slices. Nothing touches the disk. A failure after the state was gathered
  restarts the old layout from it.
- TP change where the bundles could not be had on a replica's node
  (``restart_tp``): new placement groups for every replica, every worker
  started anew.
"""
from __future__ import annotations

from raytp.parallel.layout import Layout
from raytp.runtime import policy
from raytp.runtime.errors import FAILURES
from raytp.runtime.launch import actor_id


class SwitchFailed(Exception):
    """A switch failed midway and was rolled back: go on with `group`."""

    def __init__(self, group, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.group, self.cause = group, cause


def switch_dp(group, new_cfg, step: int, reserved: dict | None = None, early: dict | None = None):
    """`group` at DP degree new_cfg.parallel.dp: (new group, bytes moved). `reserved`: placement of the
    added replicas (reserved now if None); `early`: {rank: (actor, bundle)} of added ranks started ahead."""
    tp, old_dp, new_dp = group.layout.tp, group.layout.dp, new_cfg.parallel.dp
    plan = policy.dp_resize_ranks(tp, old_dp, new_dp)
    added = list(range(old_dp, new_dp))
    if reserved is None:
        reserved = group.reserve(new_cfg, group.launcher.run, added,
                                 avoid_nodes=group.placer.nodes_of(group.pgs)) if added else {}
    early = dict(early or {})
    pgs = {**{q: pg for q, pg in group.pgs.items() if q < new_dp}, **reserved}
    try:
        group.leave()
        for r in plan.early:
            if r not in early:
                early[r] = group.start_worker(r, new_cfg, pgs)
        workers = list(group.workers[:len(plan.kept)]) + [early[r][0] for r in plan.early]
        nxt = group.successor(new_cfg, pgs, workers, bundles={actor_id(a): k for a, k in early.values()})
        nxt = nxt.join(setup=plan.early)
        moved = nxt.copy_shards({r: nxt.layout.coords(r)[1] for r in plan.early}, step)
    except FAILURES as e:
        group.kill_actors(a for a, _ in early.values())
        group.placer.release(reserved.values())
        raise SwitchFailed(_rejoined(group), e) from e
    group.kill(plan.removed)
    group.placer.release(group.pgs[q] for q in range(new_dp, old_dp))
    return nxt, moved


def switch_tp(group, new_cfg, reserved: tuple, early: dict):
    """`group` at TP degree new_cfg.parallel.tp, keeping replica 0's first min(old, new) ranks'
    processes: (new group, bytes moved). `reserved`: placement.reserve_tp's placement; `early`:
    {rank: (actor, bundle)} of the ranks whose names were free, started ahead."""
    old, new = group.layout, Layout(new_cfg.parallel.tp, new_cfg.parallel.dp)
    new_pgs, requested, unused = reserved
    plan = policy.tp_resize_ranks(old, new)
    started = [a for a, _ in early.values()]
    ref = None
    try:
        ref, nbytes = group.full_state_ref()
        group.kill(plan.removed)  # their names and bundles go to the new layout
        late = {r: group.start_worker(r, new_cfg, new_pgs) for r in plan.late}
        started += [a for a, _ in late.values()]
        news = {**late, **early}
        workers = list(group.workers[:len(plan.kept)]) + [news[r][0] for r in sorted(news)]
        nxt = group.successor(new_cfg, new_pgs, workers, bundles={actor_id(a): k for a, k in news.values()})
        nxt = nxt.join(setup=range(len(plan.kept), new.world_size), reshape=plan.kept, state=ref)
    except FAILURES as e:
        group.kill_actors(started)
        group.placer.release(requested)
        if ref is None:  # the old layout was not touched: it goes on as it was
            raise SwitchFailed(group, e) from e
        group.kill(plan.kept)  # they may be blocked in the failed rendezvous: the old layout starts anew
        raise SwitchFailed(_restarted(group, group.cfg, group.pgs, ref), e) from e
    group.placer.release(list(unused) + [group.pgs[q] for q in range(new.dp, old.dp)])
    return nxt, nbytes


def restart_tp(group, new_cfg):
    """`group` at another TP degree the plain way: new placement groups for every replica, every
    worker started anew: (new group, bytes moved)."""
    new = Layout(new_cfg.parallel.tp, new_cfg.parallel.dp)
    new_pgs = group.reserve(new_cfg, group.launcher.run, list(range(new.dp)))
    try:
        ref, nbytes = group.full_state_ref()
    except FAILURES as e:
        group.placer.release(new_pgs.values())
        raise SwitchFailed(group, e) from e
    group.kill(range(group.layout.world_size))  # the new ranks take the old names
    nxt = None
    try:
        nxt = type(group).create(group.launcher, new_cfg, new_pgs)
        nxt = nxt.join(setup=range(new.world_size), state=ref)
    except FAILURES as e:
        if nxt is not None:
            nxt.kill(range(new.world_size))
        group.placer.release(new_pgs.values())
        raise SwitchFailed(_restarted(group, group.cfg, group.pgs, ref), e) from e
    group.placer.release(group.pgs.values())
    return nxt, nbytes


def _rejoined(group):
    """The old layout's workers, wired again (the shards they hold are untouched)."""
    try:
        return group.join()
    except FAILURES:
        return group  # the next step fails and recovers


def _restarted(group, cfg, pgs, ref):
    """The old layout started anew from the state at `ref`."""
    fresh = type(group).create(group.launcher, cfg, pgs)
    try:
        return fresh.join(setup=range(fresh.layout.world_size), state=ref)
    except FAILURES:
        return fresh
