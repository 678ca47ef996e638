"""Getting a failed step's survivors out of it (``wait_out``), and what to do with one that does not get out.

A lost rank's closed sockets get its peers out in milliseconds. Survivors still inside a step ABORT_AFTER_S later
wait on a peer whose sockets stay open (its host frozen or gone, its process outliving its node's Ray): their
collectives are aborted (``Worker.abort_collectives``: their sockets shut), not waited out for
``runtime.collective_timeout_s``.

A survivor still inside its step STACKS_AFTER_S past the abort is asked where its threads are (the `still_blocked`
record), and judged by what its process did since the abort (``blocked_for_good``): idle (less than IDLE_CPU_SHARE
of a core), it waits on something that will never come, and is ended and replaced as a lost rank, not waited out
for collective_timeout_s (120 s by default). Seen in CI: a rank whose step began a gloo all-reduce after its peers'
pairs had failed sat in it, idle, until gloo's timeout, past any abort (docs/findings.md). A survivor still
computing (a long step of a big model reaching its next collective) uses a core and is waited for, up to
collective_timeout_s, as before. On a GPU the host of a rank inside one long kernel waits idle too: such a rank,
still in its step 6 s after its collectives were aborted, is replaced (its state from a live holder or the
snapshot: nothing lost but the time of a process start).
"""
from __future__ import annotations

import time
from typing import Mapping, NamedTuple

import ray

# Seconds survivors may stay inside a failed step before their collectives are aborted (wait_out): far past the
# milliseconds a lost rank's closed sockets take to get them out, even on a loaded machine.
ABORT_AFTER_S = 1.0
# Seconds past the abort after which a survivor still inside its step is asked where its threads are, and judged
# (blocked_for_good): an abort gets a rank out in milliseconds, and one that did not is a fault of its own to find.
STACKS_AFTER_S = 5.0
# A process that used less than this share of one core over STACKS_AFTER_S computes nothing: a worker blocked in
# a collective used 3-4% here (its Ray threads answering the status polls), one computing a step, however starved
# by a loaded machine, far more.
IDLE_CPU_SHARE = 0.1


class WaitedOut(NamedTuple):
    """What wait_out found."""
    completed: dict[int, int]  # {rank: completed steps} of the survivors whose state is that step's
    stuck: list[int]           # ranks killed still inside the step (blocked for good, or past collective_timeout_s):
                               # they count as lost
    torn: dict[int, int]       # {rank: completed steps} of those a step failed mid-update (zero 1's gather of
                               # the new weights): they keep their process, and take their state as a lost rank does
    aborted: dict              # {rank: sockets its abort shut} of those whose collectives were aborted to get them out
    stacks: dict = {}          # {rank: {thread: stack}} of those still inside their step STACKS_AFTER_S after it
    cpu: dict = {}             # {rank: share of a core its process used since the abort} of the same ranks
    ended: tuple = ()          # those of them judged blocked for good (blocked_for_good), killed then


def cpu_shares(before: Mapping[int, float | None], after: Mapping[int, float | None], seconds: float
               ) -> dict[int, float]:
    """{rank: share of one core} its process used over `seconds`, from two readings of its CPU seconds (a rank
    with either reading missing is left out)."""
    return {r: (after[r] - b) / max(seconds, 1e-9) for r, b in before.items()
            if b is not None and after.get(r) is not None}


def blocked_for_good(shares: Mapping[int, float]) -> list[int]:
    """The ranks (of those still inside their step STACKS_AFTER_S after the abort) whose process was idle since."""
    return sorted(r for r, share in shares.items() if share < IDLE_CPU_SHARE)


def wait_out(workers: list, survivors: list[int], ping_timeout_s: float, collective_timeout_s: float,
             kill) -> WaitedOut:
    """Wait until no survivor is inside a step, then have them leave their process groups (`kill(ranks)`
    ends those stuck: blocked for good STACKS_AFTER_S after the abort, or still inside past collective_timeout_s)."""
    start = time.monotonic()
    deadline, abort_at = start + collective_timeout_s, start + ABORT_AFTER_S
    completed: dict[int, int] = {}
    pending, stuck, aborted, stacks, stacks_at = list(survivors), [], {}, {}, None
    cpu_then, abort_t, shares, ended = {}, 0.0, {}, []
    while pending:
        status = dict(zip(pending, ray.get([workers[r].status.remote() for r in pending], timeout=ping_timeout_s)))
        for r, st in status.items():
            if not st["running"]:
                completed[r] = st["completed"]
                pending.remove(r)
        now = time.monotonic()
        if pending and abort_at is not None and now > abort_at:
            shut = ray.get([workers[r].abort_collectives.remote() for r in pending], timeout=ping_timeout_s)
            abort_at, aborted, stacks_at = None, dict(zip(pending, shut)), now + STACKS_AFTER_S
            cpu_then, abort_t = {r: status[r].get("cpu_s") for r in pending}, now
        if pending and stacks_at is not None and now > stacks_at:
            stacks = dict(zip(pending, ray.get([workers[r].thread_stacks.remote() for r in pending],
                                               timeout=ping_timeout_s)))
            shares = cpu_shares({r: cpu_then.get(r) for r in pending}, {r: status[r].get("cpu_s") for r in pending},
                                now - abort_t)
            ended, stacks_at = blocked_for_good(shares), None
            if ended:
                kill(ended)
                stuck += ended
                pending = [r for r in pending if r not in ended]
        if pending and time.monotonic() > deadline:
            kill(pending)
            stuck += pending
            break
        if pending:
            time.sleep(0.02)
    # Waited for: a worker is threaded, so a leave still queued could run after the rejoin that follows.
    ray.get([workers[r].leave_groups.remote() for r in completed], timeout=collective_timeout_s)
    # Read after the leave: it drops a gather of new weights still in flight, which tears the state.
    torn = {r: completed[r] for r, st in zip(completed, ray.get([workers[r].status.remote() for r in completed],
                                                                timeout=ping_timeout_s)) if st["torn"]}
    return WaitedOut({r: c for r, c in completed.items() if r not in torn}, stuck, torn, aborted, stacks, shares,
                     tuple(ended))
