"""Decisions, as pure functions: what the runtime does, separate from doing it.

Each function takes plain values (layouts, rank numbers, steps, node ids) and
returns a small decision; recovery, resize, spares and the snapshot keeper
only carry them out (Ray Train v2's ``FailurePolicy.make_decision`` is the
model). Nothing here imports Ray or touches a process, so every choice is
unit-tested in microseconds (tests/test_policy.py).
"""
from __future__ import annotations

import dataclasses
import math
from enum import Enum
from dataclasses import dataclass
from typing import Collection, Hashable, Mapping, Sequence

from raytp import config as config_mod
from raytp.parallel.layout import Layout
from raytp.moves.owners import Owners

# -- failures ----------------------------------------------------------------------------------

class OnFailure(Enum):
    """What a failed step calls for."""
    RECOVER = "recover"
    GIVE_UP = "give up"
    JOB_ERROR = "job error"


RECOVER, GIVE_UP, JOB_ERROR = OnFailure.RECOVER, OnFailure.GIVE_UP, OnFailure.JOB_ERROR


def on_failure(lost: Mapping[int, str], failures_before: int, max_failures: int) -> OnFailure:
    """A step failed and `lost` are the ranks that no longer serve: recover them, give up (too many
    losses), or fail the job at once (none lost: an error of the job itself, which would only repeat)."""
    if not lost:
        return JOB_ERROR
    if failures_before + len(lost) > max_failures:
        return GIVE_UP
    return RECOVER


@dataclass(frozen=True)
class Restore:
    """One way to give ranks their state back: the state mover plans it (raytp.runtime.state.moving) from the
    live ranks `alive` and, unless `source` is "replica", the in-memory copy of that name; the plan says
    whether it can (raytp.moves.planner.Unplannable: some lost block has no source)."""
    source: str                          # "replica", or a copy's: "snapshot", "snapshot copy"
    step: int                            # the step it restores
    alive: tuple[int, ...]               # old ranks whose live state serves (none when everyone rolls back)
    targets: tuple[int, ...]             # new ranks that take their state (every rank when everyone rolls back)


def restore_order(completed: Mapping[int, int], todo: Sequence[int], copies: Sequence[tuple[str, int]],
                  world_size: int) -> list[Restore]:
    """The ways to try, fastest first, before the newest checkpoint: at the survivors' step (`completed`:
    {old rank: completed steps} of those whose state is whole; if they disagree, none) the live holders alone,
    then with what they lack from each copy of that step (`copies`: (source, step), e.g. the snapshot and its
    copy on another node); only `todo` take state. Then everyone rolls back to each copy in turn."""
    out = []
    steps = set(completed.values())
    if len(steps) == 1:
        at, alive, todo = steps.pop(), tuple(sorted(completed)), tuple(sorted(todo))
        out += [Restore("replica", at, alive, todo)]
        out += [Restore(name, at, alive, todo) for name, step in copies if step == at]
    everyone = tuple(range(world_size))
    return out + [Restore(name, step, (), everyone) for name, step in copies]


@dataclass(frozen=True)
class Shrink:
    """Go on with fewer replicas: those in `keep` (old DP ranks, renumbered 0.. in this order)."""
    new_dp: int
    keep: tuple[int, ...]
    step: int                            # where the kept replicas are


def shrink_decision(layout: Layout, lost: Sequence[int], completed: Mapping[int, int], min_dp: int | None,
                    batch_size: int, replaced: Collection[int] = ()) -> Shrink | None:
    """Elastic shrink when lost ranks cannot be replaced: keep whole replicas (keep_replicas): each rank's state
    whole (`completed`: {rank: its step}) or its process new (`replaced`: up, to take its state anew); None if the
    job is not elastic (min_dp None), too few replicas are whole, or they disagree on the step (or hold none)."""
    if min_dp is None:
        return None
    broken = {layout.coords(r).dp for r in lost}
    whole = [q for q in range(layout.dp) if q not in broken]
    if any(r not in completed and r not in replaced for q in whole for r in layout.replica(q)):
        return None
    steps = {completed[r] for q in whole for r in layout.replica(q) if r in completed}
    keep = keep_replicas(layout, whole, min_dp, batch_size)
    if keep is None or len(steps) != 1:
        return None
    return Shrink(len(keep), keep, steps.pop())


def drain_keep(layout: Layout, nodes: Sequence[str | None], draining: Collection[str], min_dp: int | None,
               batch_size: int) -> tuple[int, ...] | None:
    """A live shrink off nodes Ray is draining when no node has room for their ranks: the replicas to keep
    (old DP ranks, renumbered 0.. in this order) among those with no rank on a drained node (keep_replicas).
    None if the job is not elastic (min_dp None), or too few replicas stay clear of the drained nodes."""
    if min_dp is None:
        return None
    hit = {layout.coords(r).dp for r, n in enumerate(nodes) if n in draining}
    clear = [q for q in range(layout.dp) if q not in hit]
    return keep_replicas(layout, clear, min_dp, batch_size) if hit else None


def dp_fits(layout: Layout, dp: int) -> bool:
    """Whether `layout` can run at DP degree `dp` (experts on a mesh of their own: ep x etp divides the new
    dp x cp x tp)."""
    try:
        layout.changed(dp=dp)
    except ValueError:
        return False
    return True


def keep_replicas(layout: Layout, candidates: Sequence[int], min_dp: int, batch_size: int) -> tuple[int, ...] | None:
    """Which of the replicas `candidates` a shrink keeps (old DP ranks, renumbered 0.. in this order): as many
    as divide the global batch and make a layout (dp_fits), at least `min_dp`; None if none do. Where experts
    have a mesh of their own, new replica i is, where one can be, a candidate whose ranks hold the experts
    (EP and ETP places) that replica i's ranks hold at the new degree: no expert moves (at DP=4 x EP=2,
    replicas 0 and 3 kept become DP=2's 0 and 1, not 0 and 2, which hold the same experts)."""
    sizes = [k for k in range(len(candidates), 0, -1) if k >= min_dp and batch_size % k == 0 and dp_fits(layout, k)]
    if not sizes:
        return None
    k = sizes[0]
    if not layout.experts_split:
        return tuple(candidates[:k])
    new, left, out = layout.changed(dp=k), list(candidates), []
    for i in range(k):
        want = _expert_places(new, i)
        q = next((q for q in left if _expert_places(layout, q) == want), left[0])
        left.remove(q)
        out.append(q)
    return tuple(out)


def _expert_places(layout: Layout, q: int) -> tuple:
    return tuple((layout.coord(r, "ep"), layout.coord(r, "etp")) for r in layout.replica(q))


def choose_spares(layout: Layout, lost: Sequence[int], nodes: Sequence[str | None],
                  ready: Sequence[tuple[Hashable, str]]) -> dict[int, Hashable]:
    """Which ready spare takes which lost rank: {rank: spare key}.

    `nodes`: the node of every rank as last placed; `ready`: (key, node) of the spares ready now.
    A lost rank takes a spare on the node of its surviving TP peers (a TP group stays inside one
    node); a TP group lost whole takes spares that share one node. Ranks left out start anew."""
    lost_set, pool, chosen = set(lost), list(ready), {}
    for q in sorted({layout.coords(r).dp for r in lost}):
        group = layout.replica(q)
        missing = [r for r in group if r in lost_set]
        peers = [nodes[r] for r in group if r not in lost_set and r < len(nodes)]
        candidates = [peers[0]] if peers else list(dict.fromkeys(node for _, node in pool))
        for node in candidates:
            here = [s for s in pool if s[1] == node]
            if len(here) >= len(missing) or peers:  # a whole lost group must land on one node
                for r, s in zip(missing, here):
                    chosen[r] = s[0]
                    pool.remove(s)
                break
    return chosen


# -- resizing (which ranks a layout change keeps and starts: raytp.runtime.elastic.rank_plans) ---

def _ceiling(max_dp: int | None, dp: int) -> int | None:
    """parallel.max_dp after a resize to `dp`: a request above it raises it (what the job grows to is then the
    request's: raytp.runtime.elastic.resize.Elastic.target_dp)."""
    return None if max_dp is None else max(max_dp, dp)


def resized_config(cfg: config_mod.JobConfig, target: Layout) -> config_mod.JobConfig:
    """The job at layout `target` (a new pp splits the layers by cost): the same global batch, the same
    micro-batch where it divides the new per-replica share (so the micro-batches, hence the numbers, stay
    those of the old layout). Raises ConfigError for a layout the job cannot take."""
    dp = target.dp
    local = cfg.train.batch_size // dp if cfg.train.batch_size % dp == 0 else cfg.train.batch_size
    micro = math.gcd(cfg.micro_batch, local)
    stages = {} if target.pp == cfg.parallel.pp else {"pp": target.pp, "pp_layers": None}
    new = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, **{**target.degrees(), **stages}, zero=target.zero,
                                          etp=target.etp, max_dp=_ceiling(cfg.parallel.max_dp, dp)),
        train=dataclasses.replace(cfg.train, micro_batch_size=micro))
    config_mod.validate(new, "scale request")
    return new


class GrowStep(Enum):
    """An elastic job below its DP target, at a step boundary: ask for the missing replicas, wait for them, or
    grow."""
    REQUEST = "request"
    WAIT = "wait"
    NOW = "grow"


GROW_REQUEST, GROW_WAIT, GROW_NOW = GrowStep.REQUEST, GrowStep.WAIT, GrowStep.NOW


def grow(layout: Layout, target_dp: int, requested: bool, placed: int, batch_size: int
         ) -> tuple[GrowStep, int] | None:
    """An elastic job at `layout` below `target_dp` (its DP after a shrink, or ``parallel.max_dp``): ask at once
    for the placement of every missing replica (the autoscaler sees the demand), wait while none is placed,
    and grow at a step boundary to the largest DP that the replicas placed so far reach, that divides the
    global batch and that makes a layout (dp_fits). `placed`: how many of the requested replicas, in DP order
    from its DP, are placed. (the step, the DP to grow to); None at the target."""
    dp = layout.dp
    if dp >= target_dp:
        return None
    if not requested:
        return GROW_REQUEST, target_dp
    sizes = [k for k in range(min(dp + placed, target_dp), dp, -1) if batch_size % k == 0 and dp_fits(layout, k)]
    return (GROW_NOW, sizes[0]) if sizes else (GROW_WAIT, dp)


# -- the training loop -------------------------------------------------------------------------

def call_length(step: int, end: int, steps_per_call: int, warm: bool, eval_every: int, save_every: int) -> int:
    """Steps in the next streamed call: steps_per_call once warm (else 1: the first completed step
    shows at once, and a resize waiting for its new ranks takes over as soon as they are up), cut at
    the end and at the next evaluation or checkpoint boundary."""
    n = min(steps_per_call if warm else 1, end - step)
    for interval in (eval_every, save_every):
        if interval:
            n = min(n, interval - step % interval)
    return n


def evaluation_due(step: int, steps: int, every: int) -> bool:
    """The validation loss is due after `step` steps: every `every` steps and at the last one."""
    return step == steps or bool(every and step % every == 0)


def checkpoint_due(step: int, steps: int, every: int, saved_step: int | None) -> bool:
    """A checkpoint is due at `step` (every `every` steps and at the last one) unless already saved."""
    return bool(every) and step > 0 and saved_step != step and (step % every == 0 or step == steps)


MAX_SNAPSHOT_INTERVAL = 50
ELSEWHERE_FACTOR = 10


def snapshot_interval(pinned: int | None, budget: float, copy_s: float | None, step_s: float | None,
                      replica_elsewhere: bool) -> int:
    """Steps between in-memory snapshots: `pinned` if the job sets one (0 = off); else as few as keep
    their cost within `budget` of the step time: a snapshot costs `copy_s` (packing the shard and
    writing it to the object store, measured), so one every ceil(copy_s / (budget * step_s)) steps;
    every step until both are measured. Where a DP replica on another node holds the same shards (a
    node loss leaves a live copy), ten times as seldom. At most MAX_SNAPSHOT_INTERVAL (x10) steps: a
    failure without a replica replays at most that many."""
    if pinned is not None:
        return pinned
    if not copy_s or not step_s or step_s <= 0:
        return 1
    every = min(max(1, math.ceil(copy_s / (budget * step_s))), MAX_SNAPSHOT_INTERVAL)
    return every * ELSEWHERE_FACTOR if replica_elsewhere else every


def replica_elsewhere(layout: Layout, nodes: Sequence[str | None]) -> bool:
    """Whether some DP replica runs wholly on nodes that replica 0 does not use."""
    if len(nodes) < layout.world_size:
        return False
    zero = {nodes[r] for r in Owners(layout).owners()}
    return any(not ({nodes[r] for r in layout.replica(q)} & zero) for q in range(1, layout.dp))


def keeper_node(layout: Layout, nodes: Sequence[str | None], alive: Sequence[str], here: str,
                current: str | None) -> tuple[str | None, str | None]:
    """Where the off-node copy of replica 0's snapshots is kept: (node, None), or (None, why not).

    `nodes`: each rank's node; `alive`: alive nodes; `here`: the driver's node; `current`: the
    keeper's node now. None is needed where another DP replica lives on another node (it is the
    copy); none is possible where no other node is alive. The current keeper stays where it is;
    a new one goes to the driver's node when that node holds none of replica 0's shards."""
    state_nodes = {nodes[r] for r in Owners(layout).owners() if r < len(nodes)}
    if any(n not in state_nodes for n in nodes):
        return None, "DP replicas on other nodes hold the same shards"
    others = [n for n in alive if n not in state_nodes]
    if not others:
        return None, "no other node: a loss of the workers' node is covered by checkpoints only"
    if current in others:
        return current, None
    return (here if here in others else others[0]), None


def fits_now(free: Sequence[Mapping[str, float]], groups: Sequence[Mapping[str, float]]) -> bool:
    """Whether packed groups (each `groups` entry: what one group needs, all of it on one node) fit in the
    nodes' `free` resources as they are: placed largest first, each on the fullest node that holds it (a
    first-fit packing: it may say no where a cleverer one fits, never yes where nothing does)."""
    room = [dict(n) for n in free]
    for need in sorted(groups, key=lambda g: -sum(g.values())):
        fit = [n for n in room if all(n.get(k, 0.0) >= v for k, v in need.items())]
        if not fit:
            return False
        node = min(fit, key=lambda n: sum(n.get(k, 0.0) for k in need))
        for k, v in need.items():
            node[k] -= v
    return True
