"""Moving a stage off its twin's node once the cluster has room (a node loss made survivable after the fact), or
off a node Ray is draining.

Placement aims the copies of each stage at nodes of their own (raytp.runtime.spread), but Ray's target
is soft: on a full cluster a DP replica's stage lands beside its twin, and that node's loss then needs the
checkpoint. When a node has room later (it joined, or another job left), the driver moves one such
stage there, one move at a time:

1. Look, as each step's record arrives (a read of the nodes' free resources, ~2 ms, on the driver while
   the workers run on), and only
   while a move could help at all (raytp.runtime.spread.could_move: never under zero 1, where no rank's
   bytes are held twice): spread.move_off_twin picks the (replica, stage) and the node.
2. Reserve: a placement group for that stage aimed at the node, asked for while training goes on. One
   that lands elsewhere, or is not placed within ``runtime.placement_timeout_s``, is dropped and that node
   not tried again until the set of nodes changes.
3. Start ahead: once the group is placed there, the stage's new workers start in it (named
   ``raytp.<run>.rank<R>.moved<K>``), still while training goes on: a process start is most of a
   move's time.
4. Move, at the next step boundary once they are up: the stage's state is exported by the state mover's
   plan (raytp.runtime.state.moving: from a holder on the new node, else the least loaded of the stage's
   own ranks and its DP twins), the old workers of the stage stop, the new ones meet the others in
   torch.distributed and take their shards (nothing lost, bit for bit), and the old group is released. Training pauses for
   this only; the ``moved`` event, logged with the first step after it, says the pause as
   metrics.jsonl shows it, and a new ``survival`` event follows.

A failure during the move is handed to the driver as any failed step is (a recovery heals it).

Drains. A node that Ray is draining (``ray drain-node``, a spot preemption with a deadline, the autoscaler's
scale-down: raytp.runtime.cluster.drains, read at most once a second as records arrive) is left the same way,
ahead of any move off a twin: spread.move_off_drained picks the stage and a node with room, and at the
boundary it moves as above (its own ranks export before they stop, so a stage with no twin, or under
zero 1, moves too). With no room an elastic job (parallel.min_dp) shrinks live instead: policy.drain_keep
picks the replicas clear of the drained nodes, and at the boundary raytp.runtime.elastic.replicas drops the
others (a ``resized`` event). A job that cannot shrink keeps its
ranks there; the node's loss is then healed as a failure.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

from raytp import names
from raytp.runtime import policy, spread
from raytp.runtime.errors import FAILURES
from raytp.runtime.records import Moving, Resizing
from raytp.runtime.cluster.slots import replaced, unused_groups
from raytp.runtime.state import moving


DRAIN_READ_S = 1.0  # how often the draining nodes are read (a GCS call), at most


@dataclass
class _Pending:
    move: spread.Move
    pg: object                 # the placement group asked for the stage
    ready: object              # its ready() ref
    placement: tuple           # the job's placement it was chosen against (a change since voids it)
    t0: float                  # asked at (perf_counter)
    early: dict = field(default_factory=dict)  # rank -> (actor, bundle) started ahead in `pg`
    pings: list = field(default_factory=list)  # refs that resolve once those are up


@dataclass(frozen=True)
class Moved:
    """What a move hands the driver: the group to adopt, and the record of the move or the failure that
    broke it off (then the driver recovers)."""
    group: object
    moving: Moving | None
    error: BaseException | None = None
    resizing: Resizing | None = None  # a live shrink off a drained node (no node had room for its ranks)


class Respread:
    def __init__(self, run: str, log, say):
        self.run, self.log, self.say = run, log, say
        self.pending: _Pending | None = None
        self.moves = 0                    # moves started (the new workers' names count them)
        self._seen: tuple | None = None   # the placement `_could` was worked out for
        self._could = False
        self._tried: set[str] = set()     # nodes a group for a move did not land on (until the nodes change)
        self._nodes: frozenset = frozenset()
        self.draining: dict[str, float] = {}  # node -> deadline (Unix s) of the nodes Ray is draining, as last read
        self._drains_read = float("-inf")     # when (monotonic)
        self._told: set[str] = set()          # drained nodes already announced
        self.shrink: tuple[int, ...] | None = None  # the replicas to keep, off drained nodes with no room elsewhere
        self._stuck: set[str] = set()         # drained nodes told to have no way off but their loss

    @property
    def under_way(self) -> bool:
        """A move or a shrink waits for the next step boundary."""
        return self.pending is not None or self.shrink is not None

    def wants_boundary(self, group) -> bool:
        """Look for a move, or take the one under way a stage further (never waits: the driver calls this
        as each step's record arrives); whether one is under way (the driver then stops at the next step
        boundary instead of submitting a call behind)."""
        self._progress(group)
        return self.under_way

    def advance(self, group, step: int) -> Moved | None:
        """At a step boundary: carry out the move under way once its workers are up; else take it (or
        the look for one) a stage further."""
        self._progress(group)
        if self.shrink is not None:
            return self._leave_drained(group, step)
        p = self.pending
        if p is None or not p.pings or not group.answered(p.pings):
            return None
        self.pending = None
        return self._move(group, p, step)

    def _progress(self, group) -> None:
        p = self.pending
        if p is None:
            self._look(group)
        elif p.placement != group.placement:  # a recovery or resize changed the job meanwhile
            self._drop(group, p)
        elif not p.early:
            if ray.wait([p.ready], timeout=0)[0]:
                if group.placer.extension_placed(p.pg, p.move.node):
                    self._start_ahead(group, p)
                else:
                    self._drop(group, p)
            elif time.perf_counter() - p.t0 > group.cfg.runtime.placement_timeout_s:
                self._drop(group, p)

    def _look(self, group) -> None:
        nodes = group.nodes()
        if self._look_for_drains(group, nodes):
            return
        if group.placement != self._seen:
            self._seen = group.placement
            self._could = bool(group.placement) and spread.could_move(group.layout, nodes)
        if not self._could:
            return
        free = group.placer.free_by_node()
        if not free:
            return
        if frozenset(free) != self._nodes:
            self._nodes, self._tried = frozenset(free), set()
        cfg = group.cfg
        move = spread.move_off_twin(group.layout, nodes,
                                    {n: r for n, r in free.items() if n not in self._tried},
                                    group.placer.replica_need(cfg, group.layout.stage_ranks))
        if move is None:
            return
        pg = group.placer.request_stage(cfg, self.run, move.dp, move.stage, move.node)
        self.pending = _Pending(move, pg, pg.ready(), group.placement, time.perf_counter())

    def _look_for_drains(self, group, nodes: list) -> bool:
        """Read which nodes Ray is draining (at most every DRAIN_READ_S: a GCS call) and, where one holds ranks,
        ask for a move of the first of its stages to a node with room, ahead of any other move. Whether a
        drained node holds ranks."""
        now = time.monotonic()
        if now - self._drains_read >= DRAIN_READ_S:
            self._drains_read, self.draining = now, group.placer.draining()
        drained = [n for n in dict.fromkeys(nodes) if n in self.draining]
        if not drained:
            return False
        for node in drained:
            if node not in self._told:
                self._told.add(node)
                ranks = [r for r, n in enumerate(nodes) if n == node]
                deadline = self.draining[node]
                left = f"{deadline - time.time():.0f}s before its deadline" if deadline else "no deadline"
                self.log.event("draining", node=node, ranks=ranks, deadline=deadline or None, reason="drain")
                self.say(f"node {node} is being drained by Ray ({left}): moving ranks {ranks} off it")
        cfg = group.cfg
        free = {n: r for n, r in (group.placer.free_by_node() or {}).items() if n not in self._tried}
        move = spread.move_off_drained(group.layout, nodes, set(self.draining), free,
                                       group.placer.replica_need(cfg, group.layout.stage_ranks))
        if move is not None:
            pg = group.placer.request_stage(cfg, self.run, move.dp, move.stage, move.node)
            self.pending = _Pending(move, pg, pg.ready(), group.placement, time.perf_counter())
            return True
        lay = group.layout
        self.shrink = policy.drain_keep(lay, nodes, set(self.draining), cfg.parallel.min_dp, cfg.train.batch_size)
        if self.shrink is None and not set(drained) <= self._stuck:
            self._stuck.update(drained)
            self.say(f"no node has room for the ranks on {', '.join(drained)} and the job cannot shrink off it "
                     f"(parallel.min_dp {cfg.parallel.min_dp}, DP={lay.dp}): they stay until the node goes, then "
                     "are recovered as after a failure")
        return True

    def _leave_drained(self, group, step: int) -> Moved:
        """Go on with the replicas clear of the drained nodes (no node had room for the others' ranks): the one
        DP change (raytp.runtime.elastic.replicas.change_dp) keeping them."""
        from raytp.runtime.elastic.reshard import SwitchFailed
        from raytp.runtime.elastic.replicas import change_dp
        keep, self.shrink = self.shrink, None
        lay, t0 = group.layout, time.perf_counter()
        dropped = [q for q in range(lay.dp) if q not in keep]
        nodes = sorted({n for q in dropped for r in lay.replica(q) if (n := group.nodes()[r]) in self.draining})
        self.say(f"no node has room for the ranks on {', '.join(nodes)}, which Ray is draining: dropping replica(s) "
                 f"{dropped}, going on at DP={len(keep)} (grows back when capacity returns)")
        try:
            nxt, moved = change_dp(group, policy.resized_config(group.cfg, lay.changed(dp=len(keep))), keep, step)
        except SwitchFailed as e:
            return Moved(e.group, None, e.cause)
        reason = f"drained node {', '.join(nodes)}; kept replicas {list(keep)} of {lay.dp}"
        return Moved(nxt, None, resizing=Resizing(t0, t0, lay, nxt.layout, moved, reason))

    def _start_ahead(self, group, p: _Pending) -> None:
        lay = group.layout
        self.moves += 1
        n = lay.stage_ranks
        pgs = {**group.pgs, p.move.dp: replaced(group.pgs[p.move.dp], p.move.stage * n, n, p.pg)}
        try:
            for r in lay.stage_group(p.move.dp, p.move.stage):
                p.early[r] = group.start_worker(r, pgs=pgs, name=names.worker_moved(self.run, r, self.moves))
        except FAILURES as e:
            self.say(f"a move off a twin's node was given up: {type(e).__name__}: {e}")
            self._drop(group, p)
            return
        p.pings.extend(group.pinged(a for a, _ in p.early.values()))

    def _drop(self, group, p: _Pending) -> None:
        """Give up move `p`: its workers and group go, and its node is not tried again until the nodes change."""
        self.pending = None
        self._tried.add(p.move.node)
        group.kill_actors(a for a, _ in p.early.values())
        group.placer.release([p.pg])

    def _move(self, group, p: _Pending, step: int) -> Moved | None:
        lay, move = group.layout, p.move
        ranks = sorted(p.early)
        t0 = time.perf_counter()
        old = group.pgs[move.dp]
        new = replaced(old, move.stage * lay.stage_ranks, lay.stage_ranks, p.pg)
        from_node = group.nodes()[ranks[0]]
        self.say(f"moving ranks {ranks} (replica {move.dp}" + (f", stage {move.stage}" if lay.pp > 1 else "")
                 + f") off node {from_node}, "
                 + ("which Ray is draining" if move.drain else "which holds their DP twins too")
                 + f", to node {move.node}")
        stay = {r: r for r in range(lay.world_size) if r not in ranks}
        try:  # every rank serves (the stage's own ranks export before they stop); new ones start empty
            moves = moving.plan(group, group.cfg, range(lay.world_size), stay, step, {r: move.node for r in ranks})
            planned, _ = moving.sources(group.state_calls(), moves)
            group.kill(ranks)
            group = group.placed_in({**group.pgs, move.dp: new}).with_workers(
                {r: a for r, (a, _) in p.early.items()}, {r: b for r, (_, b) in p.early.items()})
            group = group.join(setup=ranks)
            moving.take(group.state_calls(), planned, step, also=ranks)
        except FAILURES as e:
            return Moved(group, None, e)
        group.placer.release(unused_groups([old], [new]))
        return Moved(group, Moving(t0, tuple(ranks), from_node, move.node, reason="drain" if move.drain else "twin"))

    def release(self, group) -> None:
        """Give back what a move not carried out holds (the run ends)."""
        if self.pending is not None and group is not None:
            self._drop(group, self.pending)
        self.pending = None
