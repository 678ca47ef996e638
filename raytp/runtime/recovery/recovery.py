"""Healing a job that lost workers, without losing a step where it can be helped.

1. Detect. A dead worker process fails its streamed step call at once (Ray
   tells the driver); a hung one (stopped, stuck) makes the call miss its
   deadline. Then every worker is pinged: an answer means alive (workers are
   threaded actors, so they answer even while blocked in a collective), an
   ActorDiedError means dead, silence past ``recovery.ping_timeout_s`` means
   hung, and a hung worker is killed. Nobody lost: the step failed by itself,
   an error of the job that a recovery would only repeat (JobError).
2. Get the survivors out. gloo has no abort that unblocks a collective, so
   raytp makes the failure travel: a rank whose collective fails destroys its
   process groups, which closes its sockets, so the ranks blocked on *it* fail
   next, and so on through every group; the dead process's own sockets start
   the chain (a hung one's, once killed). A lost rank whose sockets stay open
   (its host frozen or gone) starts no chain: survivors still inside the step
   a second later have their collectives aborted (their sockets shut:
   raytp.parallel.group_sockets). Survivors keep their processes, weights and
   optimizer state.
3. Replace. A lost rank takes a ready warm spare on its TP peers' node if the
   job keeps spares (raytp.runtime.recovery.spares), else it is started again in its
   placement-group bundle (Ray re-places a lost node's bundles once capacity
   returns). No capacity within ``recovery.replace_timeout_s``: an elastic job
   shrinks to its whole replicas (``parallel.min_dp``), any other fails.
4. Restore by the state mover's plan (raytp.runtime.state.moving), fastest way
   first (raytp.runtime.policy.restore_order): the lost bytes from live holders
   among the survivors (no step lost), with what they lack from the snapshot of
   the survivors' step or its copy on another node (raytp.runtime.state.snapshots);
   else everyone rolls back to the newest snapshot, then its copy; else the
   newest checkpoint. Data and dropout are functions of the step, so the
   replay is exact. A survivor's state is that of the steps it completed: a
   step changes it only after its last collective (raytp.train.step), except
   zero 1's gather of the new weights; a survivor that failed there is "torn"
   and takes its state from the source like a lost rank.
5. Rewire: new groups at a new rendezvous; survivors rejoin, new workers set
   up. A rank lost while they meet: the others' join is aborted, they keep
   their processes and state, and the ranks set up start anew (a new try).
   The driver adopts the group this returns; its first completed step logs
   ``recovered``.

A failure during a recovery starts it again (and counts). Nothing here writes
into the driver: ``recover`` returns a ``Recovered`` (or a ``GaveUp``) and the
driver adopts its group.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ray.exceptions import ObjectLostError, OwnerDiedError, RayTaskError

from raytp.moves.planner import SourceKind, Unplannable
from raytp.moves.owners import Owners
from raytp.runtime import policy
from raytp.runtime.errors import FAILURES, JobError, JoinStuck, RecoveryFailed
from raytp.runtime.records import Healing, Resizing
from raytp.runtime.leaving import ABORT_AFTER_S, STACKS_AFTER_S
from raytp.runtime.cluster.slots import unused_groups
from raytp.runtime.state import moving
from raytp.files.checkpoint import CheckpointError

# Seconds a lost rank's replacement in its own bundle on a live node (placed at once: only its process starts) is
# waited for when other lost ranks cannot be placed (a shrink may keep its replica), at least.
REPLACED_UP_S = 60.0

if TYPE_CHECKING:  # the run's parts a recovery reads and asks (none imports this module)
    from raytp.runtime.recovery.spares import Spares
    from raytp.runtime.state.checkpoints import Checkpoints
    from raytp.runtime.state.snapshots import OffNodeCopy, Snapshots


@dataclass(frozen=True)
class RecoveryContext:
    """What a recovery needs of the run besides its workers."""
    log: object                      # the failure events (the driver's raytp.runtime.driver.metrics.RunLog)
    say: Callable[[str], None]
    spares: "Spares"
    snapshots: "Snapshots"           # of the current layout
    copy: "OffNodeCopy"              # the snapshots' copy on another node
    checkpoints: "Checkpoints"


@dataclass(frozen=True)
class Recovered:
    group: object                    # the WorkerGroup to adopt
    step: int                        # where training goes on
    healing: Healing
    failures: int                    # worker losses counted by this recovery
    replayed: tuple = ()             # (rank, record) of each step the survivors finished unread (log them)
    resizing: Resizing | None = None  # set when it healed by shrinking


@dataclass(frozen=True)
class GaveUp:
    """A recovery that could not heal the job: the group as far as it got (to adopt, so that release finds
    every actor the recovery started), and the error that ends the run."""
    group: object
    error: RecoveryFailed | JobError


class _Attempt:
    """The group as far as the recovery got (a failure midway starts again from there)."""

    def __init__(self, group, failures: int):
        self.group, self.failures, self.counted = group, failures, 0
        self.restarted: set[int] = set()  # ranks this recovery killed itself after a failed join (not losses)
        self.stuck: set[int] = set()  # ranks killed still inside an aborted join (errors.JoinStuck): losses


def recover(ctx: RecoveryContext, group, error: BaseException, step: int, failures: int) -> Recovered | GaveUp:
    """Heal `group` after `error` at `step` (the first step whose record the driver has not read;
    `failures`: worker losses so far): Recovered, or GaveUp (a JobError, or a RecoveryFailed)."""
    t0, seen = time.perf_counter(), time.time()
    attempt = _Attempt(group, failures)
    while True:
        try:
            r = _recover_once(ctx, attempt, error, step, t0)
            return dataclasses.replace(r, healing=dataclasses.replace(r.healing, seen=seen))
        except (RecoveryFailed, JobError) as e:
            return GaveUp(attempt.group, e)
        except FAILURES as e:
            ctx.say(f"failure during recovery: {type(e).__name__}: {str(e)[:200]}")
            error = e


def _recover_once(ctx: RecoveryContext, attempt: _Attempt, error, step: int, t0: float) -> Recovered:
    group = attempt.group
    cfg, lay = group.cfg, group.layout
    lost = group.find_lost(getattr(error, "ranks", ()))  # a heartbeat's RanksHung names them
    lost.update({r: "restarted" for r in attempt.restarted})  # killed by the last try: gone, answer or not
    lost.update({r: "stuck" for r in attempt.stuck})
    if not lost:  # every worker is alive: not a lost worker but an error of the job itself
        cause = getattr(error, "cause", None) or error  # a RayTaskError carries the worker's exception
        raise JobError(f"a step failed with every worker alive: {type(cause).__name__}: {cause}") from error
    out = group.wait_out([r for r in range(lay.world_size) if r not in lost])
    completed, torn, aborted = out.completed, out.torn, out.aborted
    lost.update({r: "stuck" for r in out.stuck})
    if aborted:  # their peers' sockets stayed open (raytp.parallel.group_sockets)
        ctx.say(f"rank(s) {sorted(aborted)} were still blocked on the lost ones after {ABORT_AFTER_S:g}s (their "
                f"sockets stay open: a node gone or frozen); their collectives were aborted (sockets shut: "
                f"{', '.join(f'rank {r}: {n}' for r, n in sorted(aborted.items()))})")
    if out.stacks:  # the abort did not get them out: where they were, for the record (events.jsonl `still_blocked`)
        ctx.log.event("still_blocked", ranks=sorted(out.stacks), after_s=ABORT_AFTER_S + STACKS_AFTER_S,
                      stacks={str(r): st for r, st in out.stacks.items()}, ended=list(out.ended),
                      cpu_share={str(r): round(c, 4) for r, c in out.cpu.items()})
        ended = (f"; idle since, {sorted(out.ended)} ended and replaced as lost ranks (blocked for good)"
                 if out.ended else "")
        ctx.say(f"rank(s) {sorted(out.stacks)} were still inside their step {STACKS_AFTER_S:g}s after the abort"
                f"{ended}; where their threads were: the `still_blocked` event")
    if torn:  # their state is neither step's (raytp.train.step.finish_step): it comes from the source too
        ctx.say(f"rank(s) {sorted(torn)} failed mid-update; they take their state anew")
    kept = group.kept_records({r: c for r, c in completed.items() if r not in lost}, step)
    for rank, cause in lost.items():
        where = group.placement[rank] if rank < len(group.placement) else {}
        ctx.log.event("failure", rank=rank, node=where.get("node_id"), pid=where.get("pid"), cause=cause,
                      step=step, error=f"{type(error).__name__}: {str(error)[:300]}")
        ctx.say(f"rank {rank} {cause} (pid {where.get('pid')}) at step {step}; recovering")
    losses = [r for r, cause in lost.items() if cause != "restarted"]
    attempt.restarted, attempt.stuck = set(), set()
    decision = policy.on_failure(lost, attempt.failures + len(losses) - len(lost), cfg.recovery.max_failures)
    attempt.failures += len(losses)
    attempt.counted += len(losses)
    if decision == policy.GIVE_UP:
        give_up(ctx, group, f"{attempt.failures} worker losses exceed recovery.max_failures="
                            f"{cfg.recovery.max_failures}")

    own = Owners(lay)  # where the snapshot parts of the lost ranks' state were made
    snap_nodes = {group.placement[o].get("node_id") for o in {own.owner(own.part(r)) for r in lost}
                  if o < len(group.placement)}
    group.kill(lost)  # also frees the actors' names for the replacements
    promoted = ctx.spares.take(group, list(lost))  # warm spares first: no process to start
    group = group.with_workers({r: s.actor for r, s in promoted.items()},
                               {r: s.bundle for r, s in promoted.items()})
    for rank, spare in promoted.items():
        ctx.say(f"rank {rank} is taken over by warm spare {spare.name}")
    group = attempt.group = group.started(r for r in lost if r not in promoted)
    if not group.ready(lost, cfg.recovery.replace_timeout_s):
        why = (f"no capacity to replace rank(s) {sorted(lost)} within "
               f"recovery.replace_timeout_s={cfg.recovery.replace_timeout_s:g}s")
        # Under zero 1 a torn rank's replica may be kept: it takes its state anew, with the lost ranks' rows. So may
        # a replica whose lost ranks' own nodes live (one ended as blocked for good): their replacements come up in
        # their bundles, and take their state anew.
        whole = {**completed, **torn} if lay.sharded_optimizer else completed
        live = set(group.placer.alive_nodes())
        up = group.up([r for r in lost if group.placement[r].get("node_id") in live] if group.placement else [],
                      max(cfg.recovery.replace_timeout_s, REPLACED_UP_S))
        shrink = policy.shrink_decision(lay, [r for r in lost if r not in up], whole, cfg.parallel.min_dp,
                                        cfg.train.batch_size, replaced=up)
        if shrink is None:
            give_up(ctx, group, why)
        return _shrink(ctx, attempt, shrink, lost, completed, t0, _unread(kept, step), up)
    try:
        group = attempt.group = group.join(setup=lost, started=lost)  # up: group.ready answered
    except FAILURES as e:
        # A rank lost while the others meet in torch.distributed: their join was aborted (WorkerGroup.join), and
        # the survivors keep their processes and state for the next try (but those stuck in it, killed); the
        # ranks set up in this one hold no state yet: they start anew.
        attempt.stuck = set(e.ranks) - set(lost) if isinstance(e, JoinStuck) else set()
        attempt.restarted = set(lost)
        ctx.say(f"a rank was lost while the ranks met; rank(s) {sorted(lost)} start anew, the others keep their state")
        group.kill(lost)
        raise
    everyone = {r: r for r in range(lay.world_size)}
    restored, source, _ = restore(ctx, group, group, everyone, completed, sorted({*lost, *torn}))
    if source == "snapshot" and not snap_nodes <= set(group.placer.alive_nodes()):
        source = "snapshot copy"  # a part's own node is gone: Ray served the copy kept on another node
    ahead = max(completed.values(), default=restored)
    healing = Healing(t0, max(ahead - restored, 0), source, tuple(sorted(lost)),
                      tuple(sorted(s.name for s in promoted.values())))
    return Recovered(group, restored, healing, attempt.counted, _unread(kept, step, restored))


def _unread(kept: dict, step: int, stop: int | None = None) -> tuple:
    """The (rank, record)s of `kept` (group.kept_records) of steps `step` .. `stop`-1 (all past `step`
    without `stop`): the steps the job goes on after, whose records the driver never read."""
    return tuple(kept[s] for s in sorted(kept) if s >= step and (stop is None or s < stop))


def restore(ctx: RecoveryContext, old, group, process_of: dict[int, int], completed: dict[int, int],
            todo: list[int]) -> tuple[int, str, int]:
    """Give ranks their state by the state mover's plan (raytp.runtime.state.moving): (step, source, bytes moved
    between workers and from the snapshots). `old`: the
    group whose processes served (`completed`: {its rank: completed steps} of those whose state is whole);
    `group`: the group joined now (the same one after a replacement, a shrunk one after a shrink);
    `process_of`: {rank of `group`: rank of `old` whose process it is}; `todo`: ranks of `group` whose state
    is gone. Fastest first: at the survivors' step from live holders (source "replica"), with what they lack
    from the snapshot or its copy of that step; else everyone rolls back to the snapshot, then its copy; else
    the newest checkpoint."""
    copies = _copies(ctx, old.layout)
    calls, cfg = group.state_calls(), group.cfg
    nodes = dict(enumerate(group.nodes()))
    for way in policy.restore_order(completed, todo, [(n, s) for n, s, _ in copies], group.layout.world_size):
        parts = next((p for n, s, p in copies if (n, s) == (way.source, way.step)), None)
        try:
            moves = moving.plan(old, cfg, way.alive, process_of, way.step, nodes, snapshot=parts is not None)
        except Unplannable:
            continue
        try:
            planned, moved = moving.sources(old.state_calls(), moves, parts and moving.snapshot_parts(old.layout, parts()))
            moving.take(calls, planned, way.step, also=way.targets)
        except (ObjectLostError, OwnerDiedError, RayTaskError) as e:
            ctx.say(f"{way.source} of step {way.step} unavailable ({type(e).__name__}); trying the next source")
            continue  # a rank that took some of it takes all of it from the next source
        snap = any(m.source.kind is SourceKind.SNAPSHOT for m in moves)
        return way.step, way.source if snap else "replica", moved
    try:
        step, path = ctx.checkpoints.restore(group, warn=ctx.say)
    except CheckpointError as e:
        raise RecoveryFailed(f"no DP replica, snapshot or checkpoint holds the lost state of rank(s) {sorted(todo)}: "
                             f"{e}")
    return step, f"checkpoint {path}", 0  # read from storage: nothing moved between workers


def _copies(ctx: RecoveryContext, layout) -> list[tuple[str, int, Callable[[], dict]]]:
    """(source, step, its parts {part: ref}) of the in-memory copies of the state at `layout`: the newest
    snapshot, then its copy on another node."""
    out = []
    snap = ctx.snapshots.latest()
    if snap is not None:
        out.append(("snapshot", snap[0], lambda: dict(enumerate(snap[1]))))
    held = ctx.copy.held_step(layout)
    if held is not None:
        out.append(("snapshot copy", held, lambda: ctx.copy.parts(held, layout)))
    return out


def _shrink(ctx: RecoveryContext, attempt: _Attempt, shrink: policy.Shrink, lost: dict, whole: dict, t0: float,
            unread: tuple, replaced: set[int]) -> Recovered:
    """Go on with the whole replicas, renumbered in order; the others' workers and groups go. Under zero 1 the
    AdamW rows are cut again for the new DP degree: the kept ranks keep theirs, and the lost ranks' come from
    the snapshot of their step (or its copy), else everyone rolls back to the newest (restore); the job
    replays from there. `whole`: {rank: completed} of the ranks whose state is whole; `unread`: the
    survivors' records the driver has not read (those of steps before the one it goes on from are kept);
    `replaced`: lost ranks whose replacements are up (in a kept replica they take their state anew)."""
    group = attempt.group
    lay = group.layout
    group.kill(r for q in range(lay.dp) if q not in shrink.keep for r in lay.replica(q))
    group.placer.release(unused_groups([group.pgs[q] for q in range(lay.dp) if q not in shrink.keep],
                                       [group.pgs[q] for q in shrink.keep]))
    new_cfg = policy.resized_config(group.cfg, lay.changed(dp=shrink.new_dp))
    new = new_cfg.layout
    process_of = {j: o for i, q in enumerate(shrink.keep) for j, o in zip(new.replica(i), lay.replica(q))}
    workers = [group.workers[process_of[j]] for j in range(new.world_size)]
    pgs = {i: group.pgs[q] for i, q in enumerate(shrink.keep)}
    fresh = [j for j, o in process_of.items() if o in replaced]  # replacements up in a kept replica: no shard yet
    nxt = group.successor(new_cfg, pgs, workers)
    nxt.assume(fresh)
    nxt = attempt.group = nxt.join(setup=fresh, started=fresh)
    alive = {o: whole[o] for o in process_of.values() if o in whole}
    todo = [j for j, o in process_of.items() if o not in alive]
    step, source, moved = restore(ctx, group, nxt, process_of, alive, todo)
    source = "" if source == "replica" else f" from the {source}" if "snapshot" in source else f" from {source}"
    resizing = Resizing(t0, t0, lay, new, moved, f"lost capacity; kept replicas {list(shrink.keep)} of {lay.dp}")
    healing = Healing(t0, max(shrink.step - step, 0), f"shrink to DP={shrink.new_dp}" + source, tuple(sorted(lost)))
    return Recovered(nxt, step, healing, attempt.counted, tuple(x for x in unread if x[1]["step"] < step),
                     resizing=resizing)


def give_up(ctx: RecoveryContext, group, reason: str) -> None:
    """Fail with a clear message, leaving a whole checkpoint from the newest snapshot if it is newer."""
    note = ""
    snap = ctx.snapshots.latest()
    newest = ctx.checkpoints.newest()
    if snap is not None and snap[0] > (newest.step if newest is not None else -1):
        try:
            note = f"; saved the newest snapshot as {ctx.checkpoints.save_snapshot(group, snap[0], snap[1])}"
        except FAILURES + (CheckpointError,) as e:
            note = f"; the newest snapshot could not be saved ({type(e).__name__})"
    elif newest is not None:
        note = f"; newest checkpoint: {newest.where}"
    raise RecoveryFailed(reason + note)
