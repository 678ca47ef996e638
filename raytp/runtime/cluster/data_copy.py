"""The job's datasets at URLs copied to each node before workers start there.

A worker maps a URL dataset's shards from its node's cache, copying them there first if no one has
(raytp.data.fetch.local_dataset). A large dataset takes longer to copy than a worker may take to start
(runtime.placement_timeout_s + runtime.collective_timeout_s), so the launcher has every node the job is placed
on copy the datasets in a task of its own, all nodes at once, and waits for as long as the copies take, saying
how long they have been at it. Only then do workers start there, and find the copy made. A copy that fails
(disk full, the store unreachable) fails the start with the copy's own message; a node lost meanwhile fails it
as a worker lost would. Each node is copied to once a run; a node the job reaches later (recovery, a resize,
a spare) is copied to when it is reached.
"""
from __future__ import annotations

import time
from typing import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytp.data.fetch import urls_of
from raytp.runtime.cluster import placement

REPORT_EVERY_S = 30.0


@ray.remote(num_cpus=0, max_retries=0)
def _copy_on_node(urls: list[str]) -> float:
    """On the node this task runs on: each dataset of `urls` into its cache; the seconds it took."""
    from raytp.data.fetch import local_dataset
    start = time.perf_counter()
    for url in urls:
        local_dataset(url)
    return time.perf_counter() - start


class NodeCopies:
    """Which nodes hold the run's URL datasets; ``ensure`` copies them to the nodes of some placements."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.nodes: set[str] = set()   # nodes that hold every dataset
        self._groups: set[str] = set()  # placement groups whose nodes are among them

    def ensure(self, cfg, pgs: dict) -> None:
        """Copy the datasets of `cfg`'s data section that are at URLs to every node hosting `pgs`' bundles
        (dp_rank -> a replica's placement) that does not hold them yet, and wait for it. ValueError with the
        copy's message if one fails."""
        urls = urls_of(cfg.data)
        groups = {pg.id.hex() for replica in pgs.values() for pg in placement.groups_of(replica)}
        if not urls or groups <= self._groups:
            return
        hosts = placement.nodes_of(pgs)
        if not hosts:
            return  # not placed yet (a resize's ranks starting ahead): each worker copies for itself
        nodes = sorted(hosts - self.nodes)
        if nodes:
            self._copy(urls, nodes)
            self.nodes |= set(nodes)
        self._groups |= groups

    def _copy(self, urls: list[str], nodes: list[str]) -> None:
        what = ", ".join(urls)
        self.say(f"data: copying {what} to {len(nodes)} node(s) ...")
        start = time.perf_counter()
        on = [NodeAffinitySchedulingStrategy(n, soft=False) for n in nodes]
        refs = [_copy_on_node.options(scheduling_strategy=where).remote(urls) for where in on]
        pending = refs
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=REPORT_EVERY_S)
            if pending:
                self.say(f"data: still copying {what} to {len(pending)} of {len(nodes)} node(s) "
                         f"({time.perf_counter() - start:.0f} s)")
        try:
            seconds = ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ValueError):
                raise ValueError(str(e.cause)) from None
            raise
        self.say(f"data: {what} on {len(nodes)} node(s) in {time.perf_counter() - start:.1f} s "
                 f"(the slowest copy {max(seconds):.1f} s)")
