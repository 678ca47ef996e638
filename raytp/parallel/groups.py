"""torch.distributed process groups for a Layout, held as values (not globals).

Every rank creates every group of every named sub-mesh in the same order
(torch requires it) and keeps those it belongs to. A one-rank group is None: the parallel
layers treat None as "nothing to communicate". Elastic resizing destroys and
rebuilds them, which is why nothing else caches a group.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Callable
from urllib.parse import urlsplit

import torch.distributed as dist
from torch.distributed import distributed_c10d

from raytp.parallel import group_sockets
from raytp.parallel.layout import Layout

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a rendezvous store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_store(host: str, timeout_s: float = 120.0) -> dist.TCPStore:
    """A rendezvous store already listening on a free port of `host` (its ``.port``), for the process that
    will be rank 0 of a world meeting at tcp://host:port: keep it until that rank has joined.

    Rank 0's init_process_group then reuses this server (a multi-tenant TCPStore: one server per port and
    process) instead of binding one while the others try to connect: a rank that connects before the
    server listens retries only after a backoff of 0.3-0.65 s (measured, torch 2.13). The port is bound
    here, so no other program can take it between picking it and joining, as with free_port."""
    return dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, multi_tenant=True)


def connect_store(init_method: str, timeout_s: float, aborted: Callable[[], bool], host: bool = False,
                  try_s: float = 2.0) -> dist.Store:
    """A client of the store listening at `init_method` (tcp://host:port; listening_store), connected in tries of
    `try_s` until one connects, `aborted()` says the join is off, or `timeout_s` has passed; `host`: the process
    whose listening_store that is (the client then shares its server, and keeps it as long as it is held).

    torch's own client retries a lost server for its whole timeout, with no socket an abort could shut: a rank
    meeting a host that died as the ranks met (a replacement lost as it starts) waited twice
    runtime.collective_timeout_s there (docs/findings.md). A try that fails on a live but loaded host is simply
    tried again, so load slows a join and never fails it. Once connected, the store waits `timeout_s`."""
    where = urlsplit(init_method)
    if where.scheme != "tcp" or not where.hostname or not where.port:
        raise ValueError(f"a store is met at tcp://host:port, not at {init_method!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store = dist.TCPStore(where.hostname, where.port, None, host, timeout=datetime.timedelta(seconds=try_s),
                                  wait_for_workers=False, multi_tenant=host)
        except RuntimeError:  # DistNetworkError / DistStoreError: refused, reset, or no answer within try_s
            if aborted():
                raise RuntimeError(f"the join at {init_method} was aborted: a rank was lost while the ranks met")
            if time.monotonic() > deadline:
                raise
            continue
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return store


class ProcessGroups:
    """This rank's process groups, one per named sub-mesh of its layout (raytp.parallel.layout.AXES, and
    ``emb``: the first and last stage, where a tied embedding's two copies live). A one-rank group, or
    one not built, is None: the parallel layers treat None as "nothing to communicate"."""

    def __init__(self, layout: Layout, rank: int, tp=None, dp=None, pp=None, emb=None, **others):
        self.layout, self.rank = layout, rank
        self.named = {"tp": tp, "dp": dp, "pp": pp, "emb": emb, "cp": None, **others}
        self.sockets: dict[int, int] = {}  # the sockets opened as they were built (init_process_groups)

    def abort(self) -> int:
        """Make a collective of these groups blocked on a peer that will never answer (its host frozen or gone)
        fail now (raytp.parallel.group_sockets); the groups are then left as after any failed collective.
        Returns the sockets shut (gloo) or groups aborted (NCCL)."""
        if dist.is_initialized() and dist.get_backend() != "gloo":
            groups = [g for g in self.named.values() if g is not None] + [dist.group.WORLD]
            for g in groups:
                g.abort()
            return len(groups)
        return group_sockets.shut(self.sockets)

    def group(self, name: str):
        """The group of the sub-mesh `name` this rank is in (None: one rank, or not built)."""
        if name not in self.named:
            raise KeyError(f"no process group {name!r} on {self.layout}; built: {', '.join(self.named)}")
        return self.named[name]

    tp = property(lambda self: self.named["tp"], doc="this rank's TP group")
    dp = property(lambda self: self.named["dp"], doc="this rank's DP group")
    pp = property(lambda self: self.named["pp"], doc="its replica's stages at its TP rank")
    emb = property(lambda self: self.named["emb"], doc="its first and last stage (tied embedding copies)")
    cp = property(lambda self: self.named["cp"], doc="its context-parallel group (its sequences' other parts)")

    @property
    def grad(self):
        """The group summing this rank's dense gradients, whose ranks the distributed optimizer cuts its rows over:
        DP x CP (its DP group at cp 1)."""
        return self.named["grad"] if self.layout.cp > 1 else self.named["dp"]

    @property
    def cp_rank(self) -> int:
        return self.layout.coords(self.rank).cp

    @property
    def grad_rank(self) -> int:
        return self.layout.grad_place(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank).tp

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank).dp

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank).pp


def group_kinds(layout: Layout) -> list[tuple[str, list[list[int]]]]:
    """The sub-meshes a layout's ranks communicate over, by name, in the order every rank creates them:
    TP, DP, PP, at cp > 1 CP and DP x CP (``grad``), the tied embedding's stages at pp > 1, and the expert mesh's
    axes where ep or etp split it."""
    kinds = [(axis, layout.groups(axis)) for axis in ("tp", "dp", "pp")]
    if layout.cp > 1:  # its part of every sequence, and the ranks its dense gradients are summed over
        kinds += [("cp", layout.groups("cp")), ("grad", layout.groups(("dp", "cp")))]
    if layout.pp > 1:
        kinds.append(("emb", layout.embedding_groups()))
    if layout.experts_split:
        kinds += [(axis, layout.groups(axis)) for axis in ("ep", "etp", "edp")]
    return kinds


def init_process_groups(layout: Layout, rank: int, init_method: str, device: str = "cpu",
                        timeout_s: float = 120.0, store: dist.Store | None = None) -> ProcessGroups:
    """Join the world (rendezvous at `init_method`, e.g. tcp://host:port, or in `store`, this rank's client of
    that store or the store itself) and build its groups by name."""
    backend = BACKENDS[device]
    if backend == "gloo" and "127.0.0.1" in init_method:
        # Keep gloo's data connections on loopback too (it otherwise resolves the hostname).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    sockets: dict[int, int] = {}
    with group_sockets.opened_during(sockets):  # gloo connects each pair of a group as it is built
        try:
            meet = {"store": store} if store is not None else {"init_method": init_method}
            dist.init_process_group(backend, rank=rank, world_size=layout.world_size, timeout=timeout, **meet)
        except BaseException:
            if not dist.is_initialized():
                # torch names a world's groups by a count this process keeps, which a failed join leaves raised:
                # its next join would then wait under other names than its peers' (store keys
                # "default_pg/<count>/..."; torch 2.13). A destroyed world resets it; a failed one is reset here.
                distributed_c10d._world.group_count = 0
            raise
        groups = build_groups(layout, rank, timeout_s)
    groups.sockets = sockets
    return groups


def build_groups(layout: Layout, rank: int, timeout_s: float = 120.0) -> ProcessGroups:
    """The named groups of `layout` (group_kinds) inside an initialised world of layout.world_size ranks
    (a group of one rank is not made)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    mine = {}
    for kind, groups in group_kinds(layout):
        mine.setdefault(kind, None)
        for members in groups:
            # new_group is collective over the world: every rank calls it for every group.
            g = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
            if rank in members:
                mine[kind] = g
    for axis in ("ep", "etp", "edp"):  # None where experts have no mesh of their own (an MoE layer's dispatch
        mine.setdefault(axis, None)    # names "ep" on every layout)
    return ProcessGroups(layout, rank, **mine)


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
