"""WorkerGroup: the workers of one layout, as one value (Ray Train v2's WorkerGroup is the model).

A group holds the job as it is at this layout (its config), each replica's
placement, the worker actors in rank order, the bundle each actor sits in, and
where each rank runs once the group has met in torch.distributed. It is
frozen: replacing lost ranks, renumbering after a shrink, or moving to another
layout makes a *new* group (``with_workers``, ``started``, ``successor``),
and the driver switches to it in one place (raytp.runtime.driver.group_changes), so layout,
config, placement and workers never disagree.

Joining: every rank of a group meets the others at rank 0's address in one of
three ways, named by ``join``'s arguments: ``setup`` (a new process builds its
shard: from the seeded initialisation, or from its slices of a given state),
``reshape`` (a kept process rebuilds its shard at a new TP degree from its
slices of a given state), and rejoin (everyone else: a kept shard, new process
groups, the job and rank as they now are).

All calls to the workers go through here, so the driver, recovery and resize
never touch an actor directly (and the tests can swap this class for a fake).
Its calls that move state in and out (checkpoints, snapshots, copies between
replicas, the distributed optimizer's rows) are a value of their own,
raytp.runtime.cluster.group_state.StateCalls (``state_calls()``).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import ray

from raytp.parallel.layout import Layout
from raytp.runtime.cluster import health, placement as placements, relay
from raytp.runtime import leaving
from raytp.runtime.cluster.streaming import StepStream, direct_ranks
from raytp.runtime.cluster.group_state import StateCalls
from raytp.runtime.cluster.launch import Launcher, actor_id
from raytp.runtime.errors import FAILURES, JoinStuck
from raytp.runtime.estimate import fits_device


@dataclass(frozen=True)
class WorkerGroup:
    cfg: object                      # the JobConfig at this layout
    pgs: Mapping[int, object]        # dp_rank -> the replica's placement (a group, or a placement.Slots)
    workers: tuple                   # actor handles, rank order
    bundles: Mapping[str, tuple]     # actor id -> (placement group id, bundle index) it sits in
    launcher: Launcher = field(compare=False, repr=False)
    placement: tuple = ()            # where each rank runs ({"rank", "node_id", "pid", ...}), after a join
    relays: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # see relay()
    placer = placements              # the placement functions (a fake group brings its own)
    launcher_cls = Launcher          # how its actors are started

    # -- building groups ------------------------------------------------------------------------
    @classmethod
    def create(cls, launcher: Launcher, cfg, pgs: Mapping[int, object]) -> "WorkerGroup":
        """A worker for every rank of `cfg`'s layout, placed in `pgs` (not joined yet)."""
        workers, bundles = [], {}
        launcher.prepare_nodes(cfg, pgs)  # every node at once, before the first worker
        for rank in range(cfg.world_size):
            actor, key = launcher.start(cfg, pgs, rank)
            workers.append(actor)
            bundles[actor_id(actor)] = key
        return cls(cfg, dict(pgs), tuple(workers), bundles, launcher)

    @classmethod
    def launch(cls, launcher: Launcher, cfg, state=None) -> "WorkerGroup":
        """Reserve the placement of `cfg`'s layout, start every rank and join them, each building its
        shard from its slices of `state` (a one-device state) if given, else seeded. On a failure
        nothing is left behind."""
        pgs = cls.reserve(cfg, launcher.run, list(range(cfg.parallel.dp)))
        group = None
        try:
            group = cls.create(launcher, cfg, pgs)
            fits_device(cfg, group.first_where())  # its GPU holds its share, before any shard is built
            return group.join(setup=range(cfg.world_size), state=state)
        except BaseException:
            if group is not None:
                group.kill(range(cfg.world_size))
            cls.placer.release(pgs.values())
            raise

    def first_where(self) -> dict:
        """Rank 0's identity.where (its node, its GPU's memory), once its process is up (as long as a join
        would wait for it)."""
        rt = self.cfg.runtime
        return ray.get(self.workers[0].where.remote(), timeout=rt.placement_timeout_s + rt.collective_timeout_s)

    @classmethod
    def reserve(cls, cfg, run: str, dp_ranks: list[int], avoid_nodes=frozenset()) -> dict:
        """Placement for replicas `dp_ranks` of `cfg`, waited for (PlacementError if it cannot be had)."""
        return cls.placer.reserve_replicas(cfg, run, cfg.layout.stage_ranks, dp_ranks,
                                           cfg.runtime.placement_timeout_s, avoid_nodes=avoid_nodes)

    @property
    def layout(self) -> Layout:
        return self.cfg.layout

    def start_worker(self, rank: int, cfg=None, pgs=None, ahead: int = 0, name: str | None = None) -> tuple[object, tuple]:
        """A new actor for `rank` (of this group's layout, or of `cfg`/`pgs` not yet switched to; `ahead`,
        `name`: see Launcher.start)."""
        # the job's running actors but the one this rank had (a lost rank's: its name is freed once it is dead)
        def live():
            return frozenset(actor_id(w) for r, w in enumerate(self.workers) if w is not None and r != rank)
        return self.launcher.start(cfg or self.cfg, pgs if pgs is not None else self.pgs, rank, ahead=ahead,
                                   name=name, live=live)

    def with_workers(self, actors: Mapping[int, object], bundles: Mapping[int, tuple] | None = None) -> "WorkerGroup":
        """This group with ranks' actors replaced: {rank: actor}; `bundles`: {rank: bundle} of the new
        ones (default: the bundle of the rank's old actor). Where ranks ran stays recorded until the
        next join."""
        workers = list(self.workers)
        keys = dict(self.bundles)
        for rank, actor in actors.items():
            old = keys.get(actor_id(workers[rank]))
            workers[rank] = actor
            keys[actor_id(actor)] = (bundles or {}).get(rank, old)
        return self._with(workers=tuple(workers), bundles=self._keep(keys, workers))

    def placed_in(self, pgs: Mapping[int, object]) -> "WorkerGroup":
        """This group with replicas' placements replaced (the ranks started next take bundles there)."""
        return self._with(pgs=dict(pgs))

    def started(self, ranks: Iterable[int]) -> "WorkerGroup":
        """This group with new actors started for `ranks`, each in the rank's own bundle."""
        actors, keys = {}, {}
        for r in ranks:
            actors[r], keys[r] = self.start_worker(r)
        return self.with_workers(actors, keys)

    def successor(self, cfg, pgs: Mapping[int, object], workers: list,
                  bundles: Mapping[str, tuple] | None = None) -> "WorkerGroup":
        """A group of another layout (or renumbered) made of `workers`, some of them this group's
        (`bundles`: actor id -> bundle of the others)."""
        keys = {**self.bundles, **(bundles or {})}
        return dataclasses.replace(self, cfg=cfg, pgs=dict(pgs), workers=tuple(workers),
                                   bundles=self._keep(keys, workers), placement=())

    def assume(self, ranks: Iterable[int]) -> None:
        """The new processes of `ranks`, started for the job as it was (a shrink renumbered it), take their rank of
        this group's job."""
        ray.get([self.workers[r].assume.remote(r, self.cfg.to_dict()) for r in ranks],
                timeout=self.cfg.recovery.ping_timeout_s)

    def _with(self, **changes) -> "WorkerGroup":
        return dataclasses.replace(self, **changes)

    @staticmethod
    def _keep(keys: Mapping[str, tuple], workers) -> dict:
        return {actor_id(w): keys[actor_id(w)] for w in workers if actor_id(w) in keys}

    # -- joining ---------------------------------------------------------------------------------
    def join(self, setup: Iterable[int] = (), reshape: Iterable[int] = (), state=None,
             states: Mapping[int, object] | None = None, started: Iterable[int] = ()) -> "WorkerGroup":
        """Meet in torch.distributed at rank 0's node and build the TP and DP groups; returns this group
        with where each rank runs. Ranks in `setup` build their shard (from their slices of `state` if
        given: a raytp.files.state_sources source, or a one-device state or its ref; else seeded), ranks in
        `reshape` rebuild theirs from their slices of `state`, and every other rank rejoins with the
        shard it holds. `states`: a source per rank instead of one for all. `started`: ranks of `setup` known to be
        up (they answered a ping): the others are watched for a hang only once they answer one."""
        setup, reshape = set(setup), set(reshape)
        lay, cfg = self.layout, self.cfg
        timeout = cfg.runtime.placement_timeout_s + cfg.runtime.collective_timeout_s
        if isinstance(state, dict):
            state = ray.put(state)  # a one-device state: one copy in the object store, sliced by every worker
        up = [r for r in range(len(self.workers)) if r not in setup or r in set(started)]
        watch = health.PingWatch(self.workers, cfg.recovery.ping_timeout_s, up)  # a rank stopped while they meet
        init_method = health.all_or_first_error([self.workers[0].rendezvous_address.remote()], timeout, watch.check)[0]
        job = cfg.to_dict()
        calls = []
        for r, w in enumerate(self.workers):
            src = states.get(r, state) if states is not None else state
            if r in setup:
                calls.append(w.setup.remote(lay, init_method, src))
            elif r in reshape:
                calls.append(w.reshape.remote(lay, init_method, job, r, src))
            else:
                calls.append(w.rejoin.remote(lay, init_method, job, r))
        try:
            health.all_or_first_error(calls, timeout, watch.check)  # a rank lost: known at once, not at the timeout
        except FAILURES as e:
            stuck = self._abort_join(calls, skip=getattr(e, "ranks", ()))  # a hung rank's call never ends: killed
            if stuck:
                self.kill(stuck)
                raise JoinStuck(stuck) from e
            raise
        where = health.all_or_first_error([w.where.remote() for w in self.workers], timeout, watch.check)
        return self._with(placement=tuple(where))

    def _abort_join(self, calls: list, skip: Iterable[int] = ()) -> list[int]:
        """After a rank was lost while the ranks met: the others, held in the rendezvous or the groups' connections
        until runtime.collective_timeout_s, are got out (``Worker.abort_collectives``, again until each one's call
        has ended: a call may reach its join after an abort) and keep their processes and state. Returns the ranks
        still inside after twice recovery.ping_timeout_s (at most the collective timeout): an abort gets a call out
        in milliseconds, but not one in gloo's connection to a peer lost as they met (retried until the timeout,
        a new socket each try), nor one that reached its join after the last abort. The caller kills them: a join
        left running would meet beside the next try's in the same process."""
        ping_s = self.cfg.recovery.ping_timeout_s
        deadline = time.monotonic() + min(2 * ping_s, self.cfg.runtime.collective_timeout_s)
        skip = set(skip)
        pending = {c: (r, w) for r, (c, w) in enumerate(zip(calls, self.workers)) if r not in skip}
        while pending and time.monotonic() < deadline:
            aborts = [w.abort_collectives.remote() for _, w in pending.values()]
            ray.wait(aborts, num_returns=len(aborts), timeout=ping_s, fetch_local=False)
            _, left = ray.wait(list(pending), num_returns=len(pending), timeout=0.2, fetch_local=False)
            pending = {ref: pending[ref] for ref in left}
        return sorted(r for r, _ in pending.values())

    def commit_reshape(self, ranks: Iterable[int]) -> None:
        ray.get([self.workers[r].commit_reshape.remote() for r in ranks], timeout=self.cfg.runtime.step_timeout_s)

    def revert(self, ranks: Iterable[int]) -> None:
        """Ranks that reshaped take back their old shards (a failed switch); a rejoin wires them again."""
        ray.get([self.workers[r].revert.remote() for r in ranks], timeout=self.cfg.runtime.step_timeout_s)

    def leave(self) -> None:
        """Every worker leaves its process groups (keeping its shard), e.g. before a DP change."""
        ray.get([w.leave_groups.remote() for w in self.workers], timeout=self.cfg.runtime.step_timeout_s)

    def nodes(self) -> list[str | None]:
        """Each rank's node, as last placed."""
        return [p.get("node_id") for p in self.placement]

    # -- state in and out ------------------------------------------------------------------------
    def state_calls(self) -> StateCalls:
        """Its calls that move state in and out (checkpoints, snapshots, copies between replicas, the
        distributed optimizer's rows): raytp.runtime.cluster.group_state."""
        return StateCalls(self.workers, self.cfg)

    # -- training --------------------------------------------------------------------------------
    def run_steps(self, start: int, count: int, snapshot_every: int) -> StepStream:
        """One streamed call of `count` steps on every worker (iterate it for each step's records)."""
        return StepStream(self.workers, self.layout, start, count, snapshot_every, self.cfg.runtime.step_timeout_s,
                          relay=self.relay(), hang_s=self.cfg.recovery.hang_s, placement=self.placement)

    def relay(self) -> dict:
        """{leader: (peer ranks, ref of their handles)} (raytp.runtime.cluster.relay): made once per group,
        from where its ranks ran at the join (none before: every rank is called directly)."""
        if "plan" not in self.relays:
            plan = relay.relay_plan(direct_ranks(self.layout), self.nodes())
            self.relays["plan"] = {lead: (peers, ray.put([self.workers[p] for p in peers]))
                                   for lead, peers in plan.items() if peers}
        return self.relays["plan"]

    def evaluate(self, step: int) -> float:
        """The validation loss at `step` (a hung rank found by the heartbeat, as in a step)."""
        return health.watched_get([w.evaluate.remote(step) for w in self.workers], self.workers,
                                     self.cfg.runtime.step_timeout_s, self.cfg.recovery.hang_s, self.placement)[0]

    def logits(self, idx):
        """Full-vocabulary logits of a batch from replica 0 (every rank computes them where experts have a mesh
        of their own: a forward exchanges tokens with the ranks holding the experts)."""
        workers = self.workers if self.layout.experts_split else self.state_calls().owner_workers()
        got = ray.get([w.logits.remote(idx) for w in workers], timeout=self.cfg.runtime.step_timeout_s)
        return next(g for g in got if g is not None)  # the last stage's (every stage's at pp == 1)

    # -- health ----------------------------------------------------------------------------------
    def find_lost(self, suspects=()) -> dict[int, str]:
        """{rank: "died" | "hung"} of the workers that no longer serve; hung ones are killed. `suspects`: ranks a
        heartbeat found hung already (their pings are not waited for again)."""
        return health.find_lost(self.workers, self.cfg.recovery.ping_timeout_s, suspects, self.placement)

    def wait_out(self, survivors: list[int]) -> leaving.WaitedOut:
        """Wait until no survivor is inside a step (those blocked for good, or not out within
        runtime.collective_timeout_s, are killed: they count as lost), then have them leave their process groups
        (leaving.wait_out)."""
        return leaving.wait_out(self.workers, survivors, self.cfg.recovery.ping_timeout_s,
                               self.cfg.runtime.collective_timeout_s, self.kill)

    def kept_records(self, completed: dict[int, int], start: int) -> dict[int, tuple[int, dict]]:
        """{step: (rank, record)} of the steps from `start` that the survivors (`completed`: wait_out's)
        finished, read back from them (health.kept_records)."""
        return health.kept_records(self.workers, completed, start, self.cfg.recovery.ping_timeout_s)

    @staticmethod
    def pinged(actors: Iterable) -> list:
        """Refs that resolve once each actor is up (placed, __init__ done)."""
        return [a.ping.remote() for a in actors]

    @staticmethod
    def answered(refs: list, timeout_s: float = 0.0) -> bool:
        """Whether every ref of `pinged` has resolved (waiting up to `timeout_s`)."""
        return len(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0]) == len(refs)

    def check_up(self, actors: Iterable) -> None:
        """Raise (a Ray actor error) unless every one of `actors` answers within the placement timeout."""
        ray.get([a.ping.remote() for a in actors], timeout=self.cfg.runtime.placement_timeout_s)

    def ready(self, ranks: Iterable[int], timeout_s: float) -> bool:
        """Whether the actors of `ranks` are up (placed, __init__ done) within `timeout_s`."""
        ranks = set(ranks)
        return self.up(ranks, timeout_s) == ranks

    def up(self, ranks: Iterable[int], timeout_s: float) -> set[int]:
        """Those of `ranks` whose actors are up within `timeout_s` (one that died raises)."""
        refs = {self.workers[r].ping.remote(): r for r in ranks}
        done = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)[0] if refs else []
        ray.get(done)
        return {refs[d] for d in done}

    # -- ending ----------------------------------------------------------------------------------
    def kill(self, ranks: Iterable[int]) -> None:
        self.kill_actors(self.workers[r] for r in ranks)

    @staticmethod
    def kill_actors(actors) -> None:
        """Kill actors for good (workers of this group or not yet in it); those already gone are skipped."""
        placements.kill(actors)

    def release(self) -> None:
        """Kill every worker and remove every placement group of this group (idempotent)."""
        self.kill_actors(self.workers)
        self.placer.release(self.pgs.values())
