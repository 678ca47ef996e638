"""Warm spares: worker processes started ahead that take a lost rank's place at once.

With ``recovery.spares: N`` the driver keeps N spare ``Worker`` actors alive,
named ``raytp.<run>.spare<K>``: their processes are up, torch and raytp are
imported and the data is loaded, so a recovery skips starting a process (most
of its time). Each spare holds a bundle of the workers' shape, so a spare is
real capacity, reserved: the job's cost grows by N workers' resources.

Bundles. At the start, N bundles are reserved in a group of their own
(``raytp.<run>.spares``, PACK: on as few nodes as fit). A spare that takes
rank R's place keeps its bundle, and R's own bundle (in R's replica group) is
freed; a new spare is started there at once, in the background. So spares
drift to where workers were lost, which is where the lost rank's TP peers
are. Which bundle each actor sits in is recorded per actor (``WorkerGroup.bundles``),
so resizes, which move workers between groups, need nothing special:
``refill`` finds the free bundles of the groups the job holds, whatever they
are, and starts spares there (idle bundles a TP shrink leaves reserved
become spares too).

Choosing (raytp.runtime.policy.choose_spares). A lost rank takes a ready
spare on the node of its surviving TP peers (a TP group stays inside one
node); if its whole TP group was lost (a node loss), the group's ranks take
spares that share one node. A spare that is not ready yet (its process still
starting) is not used: the rank is started anew in its own bundle, as without
spares.

Names. Ray's actor names cannot change: a spare that becomes rank R keeps its
name ``raytp.<run>.spare<K>``; the ``placed`` event and ``raytp status`` map
ranks to actors (pid, node).
"""
from __future__ import annotations

import itertools

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group

from raytp import names
from raytp.runtime import policy
from raytp.runtime.cluster import placement
from raytp.runtime.cluster.launch import actor_id, bundle_key


class Spare:
    def __init__(self, actor, pg, index: int, name: str):
        self.actor, self.pg, self.index, self.name = actor, pg, index, name
        self.ready_ref = actor.where.remote()  # answers once the process is up and __init__ is done
        self.where: dict | None = None

    @property
    def bundle(self) -> tuple[str, int]:
        return bundle_key(self.pg, self.index)

    def ready(self) -> bool:
        """Started and alive (never waits); a dead one raises RayActorError."""
        if self.where is None:
            done, _ = ray.wait([self.ready_ref], timeout=0)
            if not done:
                return False
            self.where = ray.get(self.ready_ref)
        return True


class Spares:
    """The pool of warm spares of run `run`: `n` of them, reported through `log`."""

    def __init__(self, run: str, n: int, log):
        self.run, self.n, self.log = run, n, log
        self.pg = self.pg_ready = None
        self.pool: list[Spare] = []
        self.reported = False
        self._names = itertools.count()

    def start(self, group) -> None:
        """Ask for the spares' own group; spares start as its bundles are placed (see refill). Never
        waits: a group that cannot be placed stays a pending demand (an autoscaler sees it) and the
        job runs without spares meanwhile."""
        if not self.n:
            return
        self.pg = placement_group([placement.worker_resources(group.cfg)] * self.n, strategy="PACK",
                                  name=names.spares_group(self.run))
        self.pg_ready = self.pg.ready()
        self.refill(group)

    def groups(self, group) -> list:
        """Every placement group whose bundles may hold workers or spares (the spares' own once placed)."""
        out = [g for replica in group.pgs.values() for g in placement.groups_of(replica)]
        if self.pg is not None and ray.wait([self.pg_ready], timeout=0)[0]:
            out.append(self.pg)
        return out

    def refill(self, group) -> None:
        """Start spares in free bundles of the job's groups until there are N (never waits)."""
        if not self.n:
            return
        self.prune(group)
        used = {group.bundles.get(actor_id(w)) for w in group.workers} | {s.bundle for s in self.pool}
        free = [(pg, i) for pg in self.groups(group) for i in range(pg.bundle_count)
                if bundle_key(pg, i) not in used]
        started = []
        for pg, i in free[:max(self.n - len(self.pool), 0)]:
            name = names.spare(self.run, next(self._names))
            actor = group.launcher.start_spare(group.cfg, pg, i, name)
            self.pool.append(Spare(actor, pg, i, name))
            started.append({"name": name, "bundle": i, "group": pg.id.hex()})
        if started:
            self.log.event("spares", started=started)
        if not self.reported and len(self.pool) == self.n and all(_ready(s) for s in self.pool):
            self.reported = True
            self.log.event("spares", ready=[s.name for s in self.pool])

    def prune(self, group) -> None:
        """Forget spares that died (their node went, their group was removed by a resize)."""
        live_groups = {g.id.hex() for g in self.groups(group)} | ({self.pg.id.hex()} if self.pg is not None else set())
        keep = []
        for s in self.pool:
            try:
                if s.pg.id.hex() in live_groups:
                    s.ready()
                    keep.append(s)
                    continue
            except RayActorError:
                pass
            placement.kill([s.actor])
        self.pool = keep

    def evict(self, pg, index: int) -> None:
        """Free bundle (pg, index) of a spare (a worker is about to be started in it)."""
        for s in [s for s in self.pool if s.bundle == bundle_key(pg, index)]:
            self.pool.remove(s)
            placement.kill([s.actor])

    def take(self, group, lost: list[int]) -> dict[int, Spare]:
        """Ready spares for the lost ranks of `group` that can have one, each told its rank and job:
        {rank: spare}, removed from the pool."""
        if not self.n:
            return {}
        self.prune(group)
        ready = {s.name: s for s in self.pool if _ready(s)}
        picks = policy.choose_spares(group.layout, lost, group.nodes(),
                                     [(name, s.where["node_id"]) for name, s in ready.items()])
        chosen = {r: ready[name] for r, name in picks.items()}
        for s in chosen.values():
            self.pool.remove(s)
        if chosen:
            self.reported = False  # a "spares" event again once the pool is whole
            ray.get([s.actor.assume.remote(r, group.cfg.to_dict()) for r, s in chosen.items()],
                    timeout=group.cfg.recovery.ping_timeout_s)
        return chosen

    def release(self) -> None:
        placement.kill(s.actor for s in self.pool)
        self.pool = []
        if self.pg is not None:
            placement.release([self.pg])
            self.pg = self.pg_ready = None


def _ready(s: Spare) -> bool:
    try:
        return s.ready()
    except (RayActorError, GetTimeoutError):
        return False
