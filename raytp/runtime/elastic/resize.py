"""Elastic resizing: a new TP x DP layout for a running job, at a step boundary, in memory.

The protocol has two phases; the state moves in raytp.runtime.elastic.reshard.

``Elastic`` carries a running job's resizes between step boundaries: the
pending request, and after an elastic shrink the capacity asked back; every
switch comes back as a ``Switched`` for the driver to adopt, every answer as an
Outcome.

- ``request`` (from ``raytp scale`` through the control actor): validate the
  layout (raytp.runtime.policy.resized_config), reserve its capacity first
  (placement groups for the replicas that are new or change shape); if it
  cannot be had in time, the job goes on unchanged and the request is answered
  with the reason. Then the ranks whose actor names are free (R >= the old
  world size) start, and the job *keeps training on the old layout* while their
  processes come up (python, torch: seconds), one step per call. A TP change
  at pp > 1 (or to or from it) starts every rank of the new layout that way,
  in placement reserved beside the job.
- ``due`` and ``finish``, at each step boundary: once they all answer, switch (the only
  time training pauses: ``stall_s`` in the ``resized`` event; ``seconds``
  counts from the request). A shrink has nothing to start and switches at once.
- ``cancel`` drops a pending resize (the run stops, or a failure changed the
  layout meanwhile); ``grow`` grows an elastic job back after a shrink.

Names. A worker's actor name is ``raytp.<run>.rank<R>`` with R its *current*
rank: Ray actor names are immutable, so a process whose rank number would
change (TP 2 -> 4 at DP=2: old rank 2, replica 1, would become rank 4) is not
kept but replaced, which at DP > 1 costs the process start of replicas 1..
(it overlaps the other starts). A TP change at pp > 1 starts every new worker
ahead; one whose rank's name is still held is named ``names.worker_ahead``
(``raytp.<run>.rank<R>.next<k>``), and its repr shows its rank.

Placement. Ray cannot grow a placement group: a TP grow asks, for each replica
that stays, for an extension group of the missing bundles aimed at the
replica's node and checks where it landed (raytp.runtime.cluster.placement.reserve_tp);
if any landed on another node, the resize becomes a restage (every worker started anew, ahead).
A TP shrink asks for nothing: the bundles past the new degree stay reserved
(idle) until the replica's group is released, and a later TP grow reuses them.
When the capacity cannot be reserved ahead but the new layout fits in the
bundles the job holds (each new replica inside one old replica's bundles), the
resize switches in place: every worker exports its slices to the object store
and stops, and the new layout starts in the freed bundles (a longer pause,
nothing lost; raytp.runtime.elastic.changes.InBundles).

The global batch stays the job's ``train.batch_size``: each replica's
micro-batch stays the same and a smaller DP degree accumulates over more of
them; data order and the LR schedule are functions of the step, so the run
continues as if nothing happened (to floating-point tolerance). A resize that
fails midway rolls back to the old layout.

Every switch returns what the driver adopts; nothing here writes into the driver or its group.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from raytp import config as config_mod
from raytp.parallel.layout import Layout
from raytp.runtime import policy
from raytp.runtime.records import layout_dict
from raytp.runtime.elastic import changes, rank_plans, replicas, reshard
from raytp.runtime.cluster.resources import worker_resources
from raytp.runtime.errors import FAILURES, PlacementError
from raytp.runtime.records import AwaitingRoom, GrowBack, Outcome, PendingResize, Resizing


@dataclass(frozen=True)
class Switched:
    """A switch carried out (or rolled back): the group to go on with, and the answer."""
    group: object
    resizing: Resizing | None          # None when it was rolled back
    outcome: Outcome


def base(group) -> tuple:
    """The layout and placement groups a resize was planned against."""
    groups = [g.id.hex() for q in sorted(group.pgs) for g in group.placer.groups_of(group.pgs[q])]
    return group.layout, tuple(groups)  # the whole mesh: a change of any degree meanwhile voids the plan


class Elastic:
    """The resizes of a running job between step boundaries: ``pending`` (a requested resize whose new
    ranks are starting while the old layout trains on) and ``growing`` (after an elastic shrink, the
    capacity asked back). Holds only these records; the group is the driver's, passed in each call."""

    def __init__(self, target_dp: int, say, log):
        self.target_dp = target_dp  # an elastic job grows to this (parallel.max_dp, or back after a shrink)
        self.say, self.log = say, log
        self.pending: PendingResize | None = None
        self.growing: GrowBack | None = None
        self.asked = False  # the autoscaler was asked for the target's capacity (raytp.runtime.cluster.autoscaler)
        self.awaiting: AwaitingRoom | None = None  # a request waiting for room while the job trains on
        self.told: float | None = None  # the request (its t0) whose wait for room was said
        self.restages = 0  # resizes that started every worker ahead (their names: names.worker_ahead)

    def request(self, group, target: Layout, step: int, request_id: int | None = None, t0: float | None = None):
        """Begin moving `group` to layout `target`: an Outcome if it is refused or trivial, a Switched if it
        had to be done at once (a TP grow whose bundles landed off a replica's node; a switch inside the
        job's own bundles), else None while its new ranks start (``pending``; ``finish`` completes it at a
        step boundary where it is ``due``). Every kind of change is a plan (raytp.runtime.elastic.changes)
        carried out here the same way: reserve, start its early ranks, wait, switch."""
        if self.pending is not None or self.awaiting is not None:
            new = self.pending.new_cfg.layout if self.pending is not None else self.awaiting.target
            return Outcome.refused(f"a resize to {new} is in progress")
        t0, old = time.perf_counter() if t0 is None else t0, group.layout
        try:
            new_cfg = policy.resized_config(group.cfg, target)
        except config_mod.ConfigError as e:
            return Outcome.refused("; ".join(e.problems))
        if target == old:
            return Outcome(ok=True, layout=str(old), note="already at this layout")
        change = changes.plan_change(old, target)
        ahead = 0
        if change.restarts_all:
            self.restages += 1
            ahead = self.restages
            self.say(f"resizing {old} -> {target} (requested at step {step}): every worker starts anew")
        else:
            self.say(f"resizing {old} -> {target} (requested at step {step})")
        try:
            held = lambda q: group.placer.size_of(group.pgs[q])  # noqa: E731
            group.placer.check_room(new_cfg, change.bundles(old, target, held), f"{target}'s new ranks")
        except PlacementError as e:  # known from the nodes' free resources: nothing was asked for
            return self._no_room(group, new_cfg, change, e, t0, step, request_id)
        got, early = None, {}
        try:
            got = change.reserve(group, new_cfg)
            if got is None:  # an extension landed on another node than its replica
                self.say("more bundles could not be had on a replica's node: restarting every worker (started "
                         "ahead, in placement of their own, while the job trains on)")
                change = changes.Restage(rank_plans.restage_ranks(old, target))
                self.restages += 1
                ahead = self.restages
                got = change.reserve(group, new_cfg)
            for r in change.ranks.early:
                early[r] = group.start_worker(r, new_cfg, got.pgs, ahead=ahead)
        except (PlacementError, *FAILURES) as e:
            group.kill_actors(a for a, _ in early.values())
            if got is not None:
                group.placer.release(got.requested)
            if change.restarts_all or not isinstance(e, PlacementError):
                self.log.event("resize_refused", old=layout_dict(old), new=layout_dict(target), error=str(e))
                why = str(e) if change.restarts_all else f"resize failed and was rolled back: {type(e).__name__}: {e}"
                return Outcome.refused(why)
            return self._in_place(group, new_cfg, e, t0, step)
        self.pending = PendingResize(t0, new_cfg, change, base(group), got.reserved, got.requested, early,
                                     group.pinged(a for a, _ in early.values()), request_id if early else None)
        return None

    def _no_room(self, group, new_cfg, change, error: PlacementError, t0: float, step: int, request_id):
        """No room beside the job now: switch inside its own bundles where the new layout fits there, else
        wait for room while the job trains on (``retry`` at each step boundary): None then."""
        new = new_cfg.layout
        inside = None if change.restarts_all else changes.InBundles.of(group, new)
        if inside is not None:
            return self._in_place(group, new_cfg, error, t0, step, inside)
        if self.told != t0:  # once per request
            self.told = t0
            self.say(f"no room for {new} beside the job yet: training on, and looking again at each step boundary "
                     f"for up to runtime.placement_timeout_s={group.cfg.runtime.placement_timeout_s:g}s")
        self.awaiting = AwaitingRoom(t0, new, base(group), request_id, str(error))
        return None

    def retry(self, group, step: int) -> tuple[int | None, object] | None:
        """At a step boundary, for a request waiting for room: (the request to answer, what ``request``
        gives now: an Outcome, a Switched); None without one, or while it still waits or its new ranks start.
        Past runtime.placement_timeout_s it is refused; a layout changed meanwhile (a failure healed by
        shrinking) cancels it."""
        a, self.awaiting = self.awaiting, None
        if a is None:
            return None
        if base(group) != a.base:
            return a.request_id, Outcome.refused("resize cancelled: the layout changed while it waited for room")
        timeout = group.cfg.runtime.placement_timeout_s
        if time.perf_counter() - a.t0 >= timeout:
            old = group.layout
            self.log.event("resize_refused", old=layout_dict(old), new=layout_dict(a.target), error=a.why)
            return a.request_id, Outcome.refused(f"could not place the workers within {timeout:g}s: {a.why}")
        got = self.request(group, a.target, step, a.request_id, t0=a.t0)
        return None if got is None else (a.request_id, got)

    def _in_place(self, group, new_cfg, error: PlacementError, t0: float, step: int, change=None):
        """No room beside the job: switch inside the bundles it holds where the new layout fits there (`change`:
        the InBundles plan, if made already), else refuse."""
        old, new = group.layout, new_cfg.layout
        change = change or changes.InBundles.of(group, new)
        if change is None:
            self.log.event("resize_refused", old={"tp": old.tp, "dp": old.dp}, new={"tp": new.tp, "dp": new.dp},
                           error=str(error))
            return Outcome.refused(str(error))
        self.say(f"no room to start TP={new.tp} x DP={new.dp} beside the job ({error}); switching inside its "
                 "own bundles")
        got = change.reserve(group, new_cfg)
        p = PendingResize(t0, new_cfg, change, base(group), got.reserved, got.requested, {}, [])
        return carry_out(group, lambda: change.switch(group, p, step), t0, "requested, in place", step)

    def due(self, group, now: bool = False) -> bool:
        """Whether the pending resize switches at this step boundary: at once if `now` or it has no new
        ranks to wait for (a shrink); else once its new ranks are all up, or the wait is over (placement
        timeout: the switch is tried anyway, and rolls back), or the layout changed under it (``finish``
        cancels it then)."""
        p = self.pending
        if p is None:
            return False
        if now or not p.early or base(group) != p.base or not p.ready or group.answered(p.ready):
            return True
        return time.perf_counter() - p.t0 >= group.cfg.runtime.placement_timeout_s

    def finish(self, group, step: int) -> tuple[int | None, object]:
        """Switch to the pending layout now: (the request to answer, the Switched, or the Outcome of a
        cancelled one)."""
        p, self.pending = self.pending, None
        if base(group) != p.base:  # a failure was healed by shrinking meanwhile: the plan no longer fits
            return p.request_id, _drop(group, p, "the layout changed while its new workers started "
                                                 "(a failure was healed)")
        switch = lambda: p.change.switch(group, p, step)  # noqa: E731
        return p.request_id, carry_out(group, switch, p.t0, "requested", step)

    def cancel(self, group, why: str) -> tuple[int | None, Outcome] | None:
        """Drop the pending resize, if any: its new ranks stop and its placement groups go; the job is
        untouched. (the request to answer, the Outcome)."""
        p, self.pending = self.pending, None
        if p is None and self.awaiting is not None:
            a, self.awaiting = self.awaiting, None
            return a.request_id, Outcome.refused(f"resize cancelled: {why}")
        return None if p is None else (p.request_id, _drop(group, p, why))

    def grow(self, group, step: int):
        """Below the DP target (parallel.max_dp, or back after a shrink): the missing replicas' groups are asked
        for at once, and the autoscaler for the target (cluster.autoscaler); at each step boundary the job grows
        as far as the groups placed so far reach (policy.grow). Never blocks. A Switched once it grew; else None."""
        lay = group.layout
        if self.growing is not None and min(self.growing.pgs) != lay.dp:  # the layout changed under the request
            self._stop_growing(group)
        placed = 0
        if self.growing is not None:
            while lay.dp + placed in self.growing.pgs and group.placer.placed([self.growing.pgs[lay.dp + placed]]):
                placed += 1
        decision = policy.grow(lay, self.target_dp, self.growing is not None, placed, group.cfg.train.batch_size)
        if decision is None:
            self._stop_growing(group)
            return None
        what, dp = decision
        if what == policy.GROW_WAIT:
            return None
        if what == policy.GROW_REQUEST:
            self.growing = GrowBack(group.placer.request_replicas(
                group.cfg, group.launcher.run, lay.stage_ranks, list(range(lay.dp, self.target_dp)),
                avoid_nodes=group.placer.nodes_of(group.pgs)))
            group.placer.ask_capacity([worker_resources(group.cfg)] * (lay.replica_size * self.target_dp))
            self.asked = True
            self.say(f"DP={lay.dp} of {self.target_dp}: asked for {self.target_dp - lay.dp} more replica(s); "
                     "training on meanwhile")
            return None
        self.say(f"room for {dp - lay.dp} more replica(s): growing to {lay.changed(dp=dp)}")
        new_cfg = policy.resized_config(group.cfg, lay.changed(dp=dp))
        reserved = {q: self.growing.pgs[q] for q in range(lay.dp, dp)}
        rest = {q: pg for q, pg in self.growing.pgs.items() if q >= dp}
        sw = carry_out(group, lambda: replicas.change_dp(group, new_cfg, replicas.kept_first(lay.dp, dp), step,
                                                          reserved=reserved),
                       time.perf_counter(), "capacity returned", step)
        if sw.outcome.ok:  # at the target the next boundary withdraws the autoscaler request (policy.grow: None)
            self.growing = GrowBack(rest) if rest else None
        else:
            self.say(f"growing failed and was rolled back: {sw.outcome.error}")
            self.growing = None  # its groups went with the rollback; asked for again at the next boundary
            group.placer.release(rest.values())
        return sw

    def _stop_growing(self, group) -> None:  # the groups asked for and not used go; the autoscaler request too
        if self.growing is not None:
            group.placer.release(self.growing.pgs.values())
            self.growing = None
        if self.asked:
            group.placer.withdraw_capacity()
            self.asked = False

    def release(self, group) -> tuple[int | None, Outcome] | None:
        """Drop what is in progress (the run ends): the pending request's answer, if any."""
        self._stop_growing(group)
        return self.cancel(group, "the run ended")


def _drop(group, p: PendingResize, why: str) -> Outcome:
    group.kill_actors(a for a, _ in p.early.values())
    group.placer.release(p.requested)
    return Outcome.refused(f"resize cancelled: {why}")


def carry_out(group, switch, t0: float, reason: str, step: int) -> Switched:
    """Run a reshard switch; a failure is rolled back (the Switched then carries the old layout)."""
    t_switch, old = time.perf_counter(), group.layout
    try:
        nxt, moved = switch()
    except reshard.SwitchFailed as e:
        return Switched(e.group, None, Outcome.refused(f"resize failed and was rolled back: {e}"))
    resizing = Resizing(t0, t_switch, old, nxt.layout, moved, reason)
    return Switched(nxt, resizing, Outcome(ok=True, layout=str(nxt.layout), bytes=moved, step=step))
