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


def kept_records(workers: list, completed: dict[int, int], start: int, ping_timeout_s: float
                 ) -> dict[int, tuple[int, dict]]:
    """The records of steps `start` .. that survivors finished ({rank: completed steps}), read back from
    the records each rank keeps (raytp.runtime.worker.worker.Worker.kept_records): {step: (rank, record)},
    each step from the lowest rank that has it. The survivors furthest ahead are asked first, one at a
    time, until every step they finished is found (a rank that joined late lacks the steps before it)."""
    stop = max(completed.values(), default=start)
    out: dict[int, tuple[int, dict]] = {}
    for rank in sorted(completed, key=lambda r: (-completed[r], r)):
        if completed[rank] <= start or all(s in out for s in range(start, stop)):
            break
        try:
            got = ray.get(workers[rank].kept_records.remote(start, completed[rank]), timeout=ping_timeout_s)
        except (RayActorError, ray.exceptions.GetTimeoutError):
            continue
        for rec in got:
            out.setdefault(rec["step"], (rank, rec))
    return dict(sorted(out.items()))
