"""Whether a group's workers still serve: lost-rank detection and getting survivors out of a failed step.

Pure of the group: each function takes the workers (actor handles, rank order) and its timeouts, and
is linear in the world size (one batched ping and wait; sets, not `in` on lists of refs).
"""
from __future__ import annotations

import time

import ray
from ray.exceptions import RayActorError


def find_lost(workers: list, ping_timeout_s: float) -> dict[int, str]:
    """{rank: "died" | "hung"} of the workers that no longer serve; hung ones are killed."""
    pings = [w.ping.remote() for w in workers]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=ping_timeout_s)
    answered = set(ready)  # a set: `in` a list of refs made this quadratic (104 ms at 1024 ranks)
    lost = {}
    for rank, ref in enumerate(pings):
        if ref not in answered:
            lost[rank] = "hung"
            ray.kill(workers[rank], no_restart=True)
    try:
        ray.get(ready)  # one batched get; only a rank that died makes it raise
    except RayActorError:
        for rank, ref in enumerate(pings):
            if ref in answered:
                try:
                    ray.get(ref)
                except RayActorError:
                    lost[rank] = "died"
    return dict(sorted(lost.items()))


def wait_out(workers: list, survivors: list[int], ping_timeout_s: float, collective_timeout_s: float,
             kill) -> tuple[dict[int, int], list[int]]:
    """Wait until no survivor is inside a step, then have them leave their process groups:
    ({rank: completed steps}, [ranks that did not get out within collective_timeout_s, killed by
    `kill(ranks)`: they count as lost])."""
    deadline = time.monotonic() + collective_timeout_s
    completed: dict[int, int] = {}
    pending, stuck = list(survivors), []
    while pending:
        statuses = ray.get([workers[r].status.remote() for r in pending], timeout=ping_timeout_s)
        for r, st in zip(list(pending), statuses):
            if not st["running"]:
                completed[r] = st["completed"]
                pending.remove(r)
        if pending and time.monotonic() > deadline:
            kill(pending)
            stuck = list(pending)
            break
        if pending:
            time.sleep(0.02)
    # Waited for: a worker is threaded, so a leave still queued could run after the rejoin that follows.
    ray.get([workers[r].leave_groups.remote() for r in completed], timeout=collective_timeout_s)
    return completed, stuck
