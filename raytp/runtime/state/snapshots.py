"""In-memory snapshots: the newest state of every shard, in the Ray object store.

Workers yield a copy of their shard state every `recovery.snapshot_every`
steps from their streaming step call (taken between two steps and written to
the object store while the next step runs, see ``Worker.run_steps``); an
object yielded that way is owned by the caller, the driver, so it outlives
the worker that made it. Only DP replica 0 snapshots, as the other replicas
hold the same shards. A snapshot is usable once every TP rank's part of the
same step has arrived.

Its primary copy lives in the object store of replica 0's node, so a loss of
that node would take the snapshot with it. Where no other DP replica lives on
another node (a DP=1 job, or all replicas on one node), ``OffNodeCopy`` keeps
a second copy of the newest complete snapshot on another node (the driver's
node when it hosts none of replica 0's workers, else any other alive node),
pulled there by a small keeper actor while training goes on. It is refreshed
whenever the previous pull has finished, so it may trail the newest snapshot
by a few steps on a slow network; it costs that node one snapshot of object
store memory (the full model and optimizer state over TP ranks). Where DP
replicas sit on other nodes, they are the off-node copy and no keeper runs.
"""
from __future__ import annotations

import itertools
import time

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytp import names
from raytp.moves.owners import Owners
from raytp.runtime import policy
from raytp.runtime.cluster import placement


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


class Cadence:
    """How often replica 0 snapshots: pinned by the job, or chosen from what snapshots and steps cost
    (raytp.runtime.policy.snapshot_interval), from the last few steps' records. The chosen interval
    is kept apart from the pin, so a job whose pin is lifted goes on at the measured interval.

    What a snapshot costs is what it adds to the wall time: the worker packs it while the next step
    runs (that step's update waits for it) and writes it out after, so where the cores are busy (CPU
    ranks) it slows the step it overlaps more than its own measured time says. So the cost is the
    larger of the two: the snapshot's measured time, and the median step that carried one less the
    median step that did not (once both kinds are seen)."""

    WINDOW = 8

    def __init__(self, cfg):
        self.pinned, self.budget = cfg.recovery.snapshot_every, cfg.recovery.snapshot_budget
        self.chosen = policy.snapshot_interval(None, self.budget, None, None, False)
        self.copy_s: list[float] = []
        self.step_s: list[float] = []     # steps that carried no snapshot
        self.carrying: list[float] = []   # steps that overlapped a snapshot's packing and write

    @property
    def every(self) -> int:
        """The interval in force: the job's pin if it sets one, else the chosen one."""
        return self.pinned if self.pinned is not None else self.chosen

    def observe(self, record: dict) -> None:
        """A step's record (rank 0's): its step time, and the cost of the last snapshot it packed. The
        snapshot after step s-1 (every `every` steps) is packed while step s runs."""
        step = record.get("step", 0)
        if self.every and step > 0 and step % self.every == 0:
            self.carrying = (self.carrying + [record["step_time_s"]])[-self.WINDOW:]
        else:
            self.step_s = (self.step_s + [record["step_time_s"]])[-self.WINDOW:]
        if record.get("snapshot_s"):
            self.copy_s = (self.copy_s + [record["snapshot_s"]])[-self.WINDOW:]

    def cost(self) -> float | None:
        """What one snapshot adds to the wall time (see the class doc); None until measured."""
        copy = _median(self.copy_s)
        if copy is None or not self.carrying or not self.step_s:
            return copy
        return max(copy, _median(self.carrying) - _median(self.step_s))

    def follow(self, cfg) -> None:
        """Take the pin and budget of the job as it now is."""
        self.pinned, self.budget = cfg.recovery.snapshot_every, cfg.recovery.snapshot_budget

    def choose(self, cfg, layout, nodes) -> int | None:
        """Choose the interval for the next call (of the job as it now is); returns the interval in
        force if it changed (else None)."""
        before = self.every
        self.follow(cfg)
        step_s = _median(self.step_s) or _median(self.carrying)
        self.chosen = policy.snapshot_interval(None, self.budget, self.cost(), step_s,
                                               policy.replica_elsewhere(layout, nodes))
        return self.every if self.every != before else None


class Snapshots:
    """The in-memory snapshots of one layout's state: each a part per owner (raytp.moves.owners), refs
    kept in the object store by the ranks that packed them."""

    def __init__(self, layout):
        self.layout = layout
        self.parts = Owners(layout).parts
        self.by_step: dict[int, list] = {}

    def add(self, step: int, part: int, ref) -> None:
        """Part `part` of the state after `step` completed steps."""
        self.by_step.setdefault(step, [None] * self.parts)[part] = ref
        newest = self.latest()
        if newest is not None:  # older snapshots are never needed again: free them
            for s in [s for s in self.by_step if s < newest[0]]:
                del self.by_step[s]

    def latest(self) -> tuple[int, list] | None:
        """(step, [ref per part]) of the newest complete snapshot, if any."""
        complete = [s for s, refs in self.by_step.items() if all(r is not None for r in refs)]
        return (max(complete), self.by_step[max(complete)]) if complete else None


class Keeper:
    """Holds one complete snapshot in its node's object store (a Ray actor, no CPU reserved)."""

    def __init__(self):
        self.step, self.layout, self.parts = None, None, None

    def hold(self, step: int, layout, refs: list) -> int:
        """Pull snapshot `step` of `layout` (a list of refs, one per part) to this node and keep it."""
        parts = ray.get(refs)  # zero-copy views of this node's object store: pinned while held
        self.step, self.layout, self.parts = step, layout, parts
        return step

    def holding(self) -> tuple:
        """(step, layout) of the snapshot held."""
        return self.step, self.layout

    def part(self, step: int, part: int) -> dict:
        if step != self.step:
            raise KeyError(f"the keeper holds step {self.step}, not {step}")
        return self.parts[part]


_KEEPERS = itertools.count()  # a new keeper's name must not wait for the old one's to be freed
RECHECK_S = 30.0  # how often a job without a keeper looks again for a node to put one on


class OffNodeCopy:
    """The driver's side of the keeper: where it runs, which snapshot it holds, refreshing it."""

    def __init__(self, run: str, log):
        self.run, self.log = run, log
        self.checked: tuple | None = None  # (placement's nodes, time) of the last placement decision
        self.keeper = None
        self.node: str | None = None
        self.pending = None  # (step, layout, ObjectRef of the hold call in flight)
        self.held: tuple | None = None  # (step, layout) the keeper holds
        self.said: str | None = None  # the last placement reported as an event

    def update(self, group, snapshots: Snapshots, step: int) -> None:
        """At the start and after each completed step: start the keeper where `group`'s replica 0
        needs one, and hand it the newest complete snapshot if it is idle. Never waits."""
        if not self._place(group, step):
            return
        if self.pending is not None:
            held_step, lay, ref = self.pending
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                return
            self.pending = None
            try:
                ray.get(ref)
            except (RayActorError, RayTaskError) as e:  # its node went, or the snapshot did: start over
                self.checked = None  # look for a node at once
                self._drop(step, f"the snapshot keeper failed ({type(e).__name__})")
                return
            if self.held is None:
                self._report(step, node=self.node, first_step=held_step)
            self.held = (held_step, lay)
        snap, lay = snapshots.latest(), snapshots.layout
        if snap is None or (self.held is not None and self.held == (snap[0], lay)):
            return
        self.pending = (snap[0], lay, self.keeper.hold.remote(snap[0], lay, list(snap[1])))

    def held_step(self, layout) -> int | None:
        """The step of the copy of `layout`'s state the keeper holds, if any (the keeper's word, not self.held: a
        pull may have finished since the driver last looked)."""
        if self.keeper is None:
            return None
        try:
            step, held = ray.get(self.keeper.holding.remote(), timeout=10)
        except (RayActorError, ray.exceptions.GetTimeoutError):
            return None
        return step if step is not None and held == layout else None

    def parts(self, step: int, layout) -> dict[int, object]:
        """{part: ref} of the copy of `step` of `layout`'s state the keeper holds."""
        return {p: self.keeper.part.remote(step, p) for p in range(Owners(layout).parts)}

    def _place(self, group, step: int) -> bool:
        """Run the keeper on a node without replica 0's state; False where none is needed or exists."""
        nodes = group.nodes()
        if self.checked is not None and self.checked[0] == nodes and (
                self.keeper is not None or time.monotonic() - self.checked[1] < RECHECK_S):
            return self.keeper is not None
        self.checked = (nodes, time.monotonic())
        alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        here = ray.get_runtime_context().get_node_id()
        node, why = policy.keeper_node(group.layout, nodes, alive, here, self.node if self.keeper else None)
        if node is None:
            self._drop(step, why)
            return False
        if self.keeper is not None and node == self.node:
            return True
        self._drop(step, None)
        self.keeper = ray.remote(Keeper).options(
            name=names.keeper(self.run, next(_KEEPERS)), namespace=names.NAMESPACE, num_cpus=0, max_concurrency=2,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        self.node = node
        return True

    def _drop(self, step: int, why: str | None) -> None:
        self.release()
        if why is not None:
            self._report(step, reason=why)

    def _report(self, step: int, **what) -> None:
        key = repr(sorted(what.items()))
        if key != self.said:
            self.said = key
            self.log.event("snapshot_copy", step=step, **what)

    def release(self) -> None:
        if self.keeper is not None:
            placement.kill([self.keeper])
        self.keeper, self.node, self.pending, self.held = None, None, None, None
