"""Relayed calls: a streamed call reaches most ranks through one rank of their node.

Submitting an actor call costs the driver ~0.1 ms of CPU inside Ray, whatever
the call; at 1024 ranks every 10-step call of 1 s steps cost 1% of the
driver's time in submissions alone (bench/driver_scale.py). So the driver
submits a streamed call itself only to the ranks whose objects it must own or
read every step (``StepStream``: the reporting ranks and the owners of the
state, whose snapshot parts must outlive their worker), and to one *leader*
per node among the rest; a leader hands the call to the other ranks of its
node (at most ``FAN_OUT`` each), runs its own part, and ends once every one
of them has ended, with the first error one of them ended with. Those ranks
yield nothing (``report=False``): their ends and errors are all the driver
needs, and it gets them through their leader. Health checks (``find_lost``)
still ask every rank directly.

``relay_plan`` is a pure function of the ranks' nodes; ``forward`` and
``collect`` are what a leader does with its peers' handles.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import ray

FAN_OUT = 16  # ranks one leader hands a call to: a node's GPUs, or a share of them


def relay_plan(direct: Iterable[int], nodes: Sequence[str | None], fan_out: int = FAN_OUT) -> dict[int, list[int]]:
    """{leader: [peers]} for the ranks 0..len(nodes)-1 not in `direct`: those of one node in rank
    order, cut into runs of at most fan_out + 1, the first of each run its leader. A rank whose node
    is not known leads a run of its own (nothing to share a node with)."""
    direct = set(direct)
    by_node: dict[str, list[int]] = {}
    plan: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        if rank in direct:
            continue
        if node is None:
            plan[rank] = []
        else:
            by_node.setdefault(node, []).append(rank)
    for ranks in by_node.values():
        for i in range(0, len(ranks), fan_out + 1):
            run = ranks[i:i + fan_out + 1]
            plan[run[0]] = run[1:]
    return dict(sorted(plan.items()))


def forward(peers: list, args: tuple) -> list:
    """A leader hands the call `args` (run_steps' after its own `report`/`relay`) to `peers` (actor
    handles): their streams, each yielding nothing."""
    return [p.run_steps.options(num_returns="streaming").remote(*args, False, None) for p in peers]


def collect(streams: list, raising: bool = True) -> None:
    """Wait until every one of `streams` has ended; raise the first error one ended with (or take them
    all and raise nothing, `raising=False`: the leader has its own error to report)."""
    first = None
    for stream in streams:
        try:
            for ref in stream:
                ray.get(ref)  # a relayed rank yields nothing: an item is its error
        except Exception as e:  # noqa: BLE001 - kept, raised below once all have ended
            first = first or e
    if first is not None and raising:
        raise first
