"""Starting worker actors: in a rank's bundle, named after the rank, threaded.

Workers are threaded actors (``max_concurrency``), so they answer pings and
status calls while a step runs, which is how the driver tells a hung worker
from a slow one. A replacement for a dead actor may have to wait a moment
until Ray frees the dead one's name; a worker started ahead of a layout whose
rank still holds the name takes another (``names.worker_ahead``).
"""
from __future__ import annotations

import time
from typing import Callable, Collection

import ray
from ray.exceptions import ActorAlreadyExistsError

from raytp import names
from raytp.runtime.cluster import placement
from raytp.runtime.cluster.data_copy import NodeCopies

CONCURRENCY = 4  # a step, its stream, and the pings and status calls that watch it


def bundle_key(pg, index: int) -> tuple[str, int]:
    """How a bundle is named in the records: (placement group id, bundle index)."""
    return pg.id.hex(), index


def actor_id(actor) -> str:
    return actor._actor_id.hex()


def _held_by(name: str, live: Callable[[], Collection[str]]) -> bool:
    """Whether actor `name` is one of the actors `live()` gives (their ids): alive, not a dead one whose name
    Ray has yet to free. (Asked only when a name is taken: the ids are not worked out for every start.)"""
    live = live()
    if not live:
        return False
    try:
        return actor_id(ray.get_actor(name, namespace=names.NAMESPACE)) in live
    except ValueError:  # freed meanwhile
        return False


class Launcher:
    """Starts the actors of one run. `evict(pg, index)` is called before a worker takes a bundle
    (a warm spare sitting there makes room). Before an actor starts on a node, the job's datasets at URLs
    are copied there (raytp.runtime.cluster.data_copy; `say` tells how it goes)."""

    def __init__(self, run: str, worker_cls, evict: Callable | None = None, say: Callable | None = None):
        self.run, self.worker_cls = run, worker_cls
        self.evict = evict or (lambda pg, index: None)
        self._remote = ray.remote(worker_cls)
        self.copies = NodeCopies(say or (lambda message: None))

    def prepare_nodes(self, cfg, pgs: dict) -> None:
        """Ready the nodes of placements `pgs` (dp_rank -> a replica's) for `cfg`'s workers, all at once."""
        self.copies.ensure(cfg, pgs)

    def start(self, cfg, pgs: dict, rank: int, timeout_s: float = 30.0,
              ahead: int = 0, name: str | None = None, live: Callable[[], Collection[str]] = frozenset
              ) -> tuple[object, tuple[str, int]]:
        """The actor of `rank` of layout `cfg` placed in `pgs` (dp_rank -> replica placement), and the
        bundle it sits in. `ahead` (k > 0): started beside a layout that still runs, for the k-th resize
        that starts every worker ahead; where a running worker holds the rank's name the new one is
        named ``names.worker_ahead`` instead of waiting for it. `live`: gives the ids of the job's running actors;
        where one of them holds the rank's name (a process an elastic shrink renumbered: names cannot
        change), the new one takes the first free ``names.worker_ahead`` too. `name`: the actor's name
        instead."""
        lay = cfg.layout
        at = lay.coords(rank)
        self.prepare_nodes(cfg, {at.dp: pgs[at.dp]})
        pg, index = placement.bundle_of(pgs[at.dp], lay.bundle_index(rank))
        self.evict(pg, index)
        name = name or names.worker(self.run, rank)
        deadline = time.monotonic() + timeout_s
        while True:
            opts = placement.bundle_options(cfg, pg, index, name)
            try:
                actor = self._remote.options(**opts, max_concurrency=CONCURRENCY).remote(cfg.to_dict(), rank)
                return actor, bundle_key(pg, index)
            except ActorAlreadyExistsError:
                if ahead and name == names.worker(self.run, rank):
                    name = names.worker_ahead(self.run, rank, ahead)
                    continue
                if _held_by(name, live):
                    ahead += 1
                    name = names.worker_ahead(self.run, rank, ahead)
                    continue
                if time.monotonic() > deadline:  # a dead actor's name is freed a moment after it died
                    raise
                time.sleep(0.05)

    def start_spare(self, cfg, pg, index: int, name: str):
        """A warm spare (rank -1 until it takes one) in bundle `index` of `pg`."""
        self.prepare_nodes(cfg, {-1: pg})
        opts = placement.bundle_options(cfg, pg, index, name)
        return self._remote.options(**opts, max_concurrency=CONCURRENCY).remote(cfg.to_dict(), -1)
