"""A layout change live, across processes that reshape, start or stop: the state mover's plan carried out
(``switch``). Which processes a change keeps is raytp.runtime.elastic.rank_plans' (raytp.runtime.elastic.changes
hands them here): a TP change keeps replica 0's first min(old, new) TP ranks, a change of the stages the stages
present at both layouts, an EP change every process; a change that starts every worker anew is
raytp.runtime.elastic.changes.Restage; a DP change (no process reshapes) raytp.runtime.elastic.replicas. Nothing
touches the disk, and no new shard is seeded: each is built empty and filled.

``switch``: every live old rank exports the blocks the plan (raytp.runtime.state.moving) sends from it, each
byte once, from a holder on the new rank's node where there is one; the old ranks in the way of a rank that
starts late (its name, or its bundle) stop; the new layout meets, kept processes rebuilding their shards from
their old ones and the blocks sent to them, new ones filling empty shards; the old shards go at the commit,
and the old ranks neither kept nor in the way stop only then. A failure rolls back to the old layout: kept
processes take back their old shards, the stopped ones start again and take their state from the old ranks
still alive (or, if only they held some of it, from what they exported before they stopped). Returns the new
group and the bytes moved, or raises ``SwitchFailed`` carrying the group to go on with.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from raytp.moves.planner import Unplannable
from raytp.runtime.cluster.launch import actor_id, bundle_key
from raytp.runtime.cluster.slots import bundle_of
from raytp.runtime.errors import FAILURES
from raytp.runtime.state import moving


class SwitchFailed(Exception):
    """A switch failed midway and was rolled back: go on with `group`."""

    def __init__(self, group, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.group, self.cause = group, cause


def switch(group, new_cfg, step: int, new_pgs: Mapping, kept: Mapping[int, int], early: Mapping[int, tuple],
           late: Iterable[int] = ()):
    """`group` at `new_cfg`'s layout after `step` steps, placed in `new_pgs`: new rank j runs in old rank
    kept[j]'s process (it reshapes), in the actor early[j] (started ahead: (actor, bundle)), or, for j in
    `late`, in one started once the old ranks in its way are gone. (new group, bytes moved); SwitchFailed."""
    old, new = group.layout, new_cfg.layout
    late = list(late)
    started = [a for a, _ in early.values()]
    dying = _in_the_way(group, new, new_pgs, late)
    try:
        if started:  # one lost while it started: the old layout goes on untouched
            group.check_up(started)
        moves = moving.plan(group, new_cfg, range(old.world_size), kept, step)
        forward, moved = moving.sources(group.state_calls(), moves)
        back = _kept_back(group, step, dying)
    except FAILURES as e:
        raise SwitchFailed(group, e) from e
    try:
        group.kill(dying)  # their names or bundles go to the late ranks
        news = dict(early)
        for j in late:
            news[j] = group.start_worker(j, new_cfg, new_pgs)
            started.append(news[j][0])
        workers = [group.workers[kept[j]] if j in kept else news[j][0] for j in range(new.world_size)]
        nxt = group.successor(new_cfg, new_pgs, workers, bundles={actor_id(a): k for a, k in news.values()})
        nxt = nxt.join(setup=[j for j in range(new.world_size) if j not in kept], reshape=kept, states=forward)
        nxt.commit_reshape(kept)
    except FAILURES as e:
        group.kill_actors(started)
        raise SwitchFailed(_rolled_back(group, step, sorted(kept.values()), dying, back), e) from e
    stay = set(kept.values())
    group.kill(r for r in range(old.world_size) if r not in stay and r not in dying)
    return nxt, moved


def _in_the_way(group, new, new_pgs: Mapping, late: list[int]) -> list[int]:
    """The old ranks that must stop before the `late` ranks start: those holding a late rank's name (its rank
    number) or sitting in its bundle."""
    taken = {j for j in late if j < group.layout.world_size}
    bundles = {bundle_key(*bundle_of(new_pgs[new.coords(j).dp], new.bundle_index(j))) for j in late}
    sits = {r for r, w in enumerate(group.workers) if group.bundles.get(actor_id(w)) in bundles}
    return sorted(taken | sits)


def _kept_back(group, step: int, dying: list[int]) -> dict | None:
    """For a rollback, the state of the old ranks `dying` (about to stop) exported now if some of it is held by
    none of the old ranks that stay alive ({old rank: PlannedSource}); None if those can give it later."""
    if not dying:
        return None
    lay, gone = group.layout, set(dying)
    stay = {r: r for r in range(lay.world_size) if r not in gone}
    try:
        moving.plan(group, group.cfg, stay, stay, step)
        return None
    except Unplannable:
        moves = [m for m in moving.plan(group, group.cfg, range(lay.world_size), stay, step) if m.dst in gone]
        return moving.sources(group.state_calls(), moves)[0]


def _rolled_back(group, step: int, kept: list[int], dying: list[int], back: dict | None):
    """The old layout again after a failed switch: the kept processes take back their old shards, the ranks
    that stopped start again and take their state (`back`, exported before they stopped, or from the old ranks
    still alive), every other old rank rejoins with the shard it holds. If that fails too, the group as it
    is: its next step fails and a recovery heals it."""
    try:
        group.revert(kept)
        if not dying:
            return group.join()
        if back is None:
            stay = {r: r for r in range(group.layout.world_size) if r not in set(dying)}
            moves = [m for m in moving.plan(group, group.cfg, stay, stay, step) if m.dst in set(dying)]
            back = moving.sources(group.state_calls(), moves)[0]
        return group.started(dying).join(setup=dying, states=back)
    except FAILURES:
        return group


def rejoined(group):
    """The old layout's workers, wired again (the shards they hold are untouched)."""
    try:
        return group.join()
    except FAILURES:
        return group  # the next step fails and recovers
