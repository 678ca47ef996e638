"""torch.distributed process groups for a Layout, held as values (not globals).

Every rank creates every TP and DP group in the same order (torch requires
it) and keeps the two it belongs to. A one-rank group is None: the parallel
layers treat None as "nothing to communicate". Elastic resizing destroys and
rebuilds them, which is why nothing else caches a group.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from raytp.parallel.layout import Layout
from raytp.parallel.ownership import Ownership

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


@dataclass
class ProcessGroups:
    layout: Layout
    rank: int
    tp: object | None  # this rank's TP group, None when tp == 1
    dp: object | None  # this rank's DP group, None when dp == 1
    pp: object | None = None  # this rank's pipeline group (its replica's stages at its TP rank), None when pp == 1
    emb: object | None = None  # its first and last stage (tied embedding copies), None when pp == 1 or off them

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank).tp

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank).dp

    @property
    def owns_state(self) -> bool:
        """Whether this rank is an owner of the state (raytp.parallel.ownership): it snapshots and writes."""
        return Ownership(self.layout).owns(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank).pp


def init_process_groups(layout: Layout, rank: int, init_method: str, device: str = "cpu",
                        timeout_s: float = 120.0) -> ProcessGroups:
    """Join the world (rendezvous at `init_method`, e.g. tcp://host:port) and build the TP and DP groups."""
    backend = BACKENDS[device]
    if backend == "gloo" and "127.0.0.1" in init_method:
        # Keep gloo's data connections on loopback too (it otherwise resolves the hostname).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=layout.world_size,
                            timeout=timeout)
    return build_groups(layout, rank, timeout_s)


def build_groups(layout: Layout, rank: int, timeout_s: float = 120.0) -> ProcessGroups:
    """The TP, DP and pipeline groups of `layout` inside an initialised world of layout.world_size ranks (a
    group of one rank is not made: with pp=1 this builds what it built before pipelines existed)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    mine = {"pp": None, "emb": None}
    kinds = [("tp", layout.tp_groups()), ("dp", layout.dp_groups()), ("pp", layout.pp_groups())]
    if layout.pp > 1:
        kinds.append(("emb", layout.embedding_groups()))
    for kind, groups in kinds:
        for members in groups:
            # new_group is collective over the world: every rank calls it for every group.
            g = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
            if rank in members:
                mine[kind] = g
    return ProcessGroups(layout, rank, mine["tp"], mine["dp"], mine["pp"], mine["emb"])


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
