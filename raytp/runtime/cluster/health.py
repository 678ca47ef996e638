"""Whether a group's workers still serve: lost-rank detection and getting survivors out of a failed step.

Pure of the group: each function takes the workers (actor handles, rank order) and its timeouts, and
is linear in the world size (one batched ping and wait; sets, not `in` on lists of refs).

**The heartbeat**: a hung rank, found by what a stopped process cannot do: answer a ping.

Workers are threaded actors: a rank blocked in a collective, slow in its data, or writing a checkpoint still
answers a ping in milliseconds; a stopped process (SIGSTOP, a frozen host, a wedged driver call) answers
nothing. So while a step runs longer than the steps before it (the stream's poll interval, twice the last
step's time), the driver pings every rank of the call, a round at most every quarter of ``recovery.hang_s`` (a
round once per hang_s made a stop just after a round wait up to twice hang_s to be found), and waits up to
``hang_s`` for the answers. A rank whose ping goes unanswered that long while every other rank answered, and
answered quickly (within a quarter of it: the machine and Ray are not merely slow), is looked at by a rank
beside it on its node (/proc: ``Worker.look_at``): stopped (SIGSTOP, a frozen debugger) or asleep without using
CPU, it is declared hung (``RanksHung``), and the recovery replaces it at once; running or using CPU, it is busy
(a thread holding the GIL, a process the loaded machine starves: a 0.5 s silence of a healthy replacement in its
first steps was once taken for a hang and killed) and no verdict is given. A rank with no answering rank on its
node (a frozen host) is judged by its silence alone. Anything less sure gives no verdict: the step deadline
(``runtime.step_timeout_s``) and the recovery's ping (``recovery.ping_timeout_s``) stay the last resort. One
rank alone has no one to be compared with: only the deadline finds it hung. A rank tracing a profile is excused
(``Heartbeat.excused``): torch's profiler holds the GIL while it starts, stops and writes its trace (seconds for a
big trace or on a loaded machine), and a silent rank then was killed as hung, its trace lost. A ping answered
by the rank's death raises it: a rank whose sockets outlive it (its host frozen or gone) fails no peer's
collective, and the call would wait for their timeout (raytp.runtime.leaving.wait_out then aborts the
peers' collectives).
"""
from __future__ import annotations

import time
from typing import Iterable

import ray
from ray.exceptions import RayActorError

from raytp.runtime.errors import StepDeadline

def find_lost(workers: list, ping_timeout_s: float, suspects=(), placement=()) -> dict[int, str]:
    """{rank: "died" | "hung"} of the workers that no longer serve; hung ones are killed (``end_hung``, with
    `placement`: each rank's ``where``). `suspects`: ranks found hung already (raytp.runtime.cluster.health):
    the wait is for the others' answers only, and a suspect that has not answered by then is hung."""
    pings = [w.ping.remote() for w in workers]
    suspects = set(suspects)
    others = [p for r, p in enumerate(pings) if r not in suspects]
    ready, _ = ray.wait(others, num_returns=len(others), timeout=ping_timeout_s) if others else ([], [])
    if suspects:
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=0)
    answered = set(ready)  # a set: `in` a list of refs made this quadratic (104 ms at 1024 ranks)
    lost = {rank: "hung" for rank, ref in enumerate(pings) if ref not in answered}
    try:
        ray.get(ready)  # one batched get; only a rank that died makes it raise
    except RayActorError:
        for rank, ref in enumerate(pings):
            if ref in answered:
                try:
                    ray.get(ref)
                except RayActorError:
                    lost[rank] = "died"
    exited = end_hung(workers, [r for r, c in lost.items() if c == "hung"],
                      [r for r in range(len(workers)) if r not in lost], placement, ping_timeout_s)
    lost.update({r: "died" for r in exited})
    return dict(sorted(lost.items()))


def all_or_first_error(refs: list, timeout_s: float, between=None, slice_s: float = 0.1) -> list:
    """ray.get of `refs`, raising the first error among them as soon as it is there (ray.get of a list waits for
    every one first: a call that failed beside others blocked on it raised only when they timed out). `between()`
    is called after each `slice_s` that leaves some not done (raytp.runtime.cluster.health: a check)."""
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} calls not done within {timeout_s:g}s")
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, slice_s), fetch_local=False)
        if ready:
            ray.get(ready)  # raises the error of a failed call
        if pending and between is not None:
            between()
    return ray.get(refs)


def calls_beside(workers: list, placement, targets, alive, call) -> dict:
    """{ref: target rank} of `call(worker, pid, up)` made, for each of the `targets` ranks, on an `alive` rank on
    its node (by `placement`: each rank's {"node_id", "pid", "up"}) about its process; a target with no such rank
    gets none."""
    where = {r: placement[r] for r in range(min(len(placement), len(workers)))}
    beside = {}
    for r in alive:
        beside.setdefault(where.get(r, {}).get("node_id"), r)
    calls = {}
    for r in targets:
        peer, pid = beside.get(where.get(r, {}).get("node_id")), where.get(r, {}).get("pid")
        if peer is not None and pid:
            calls[call(workers[peer], pid, where[r].get("up"))] = r
    return calls


def end_hung(workers: list, hung: list[int], alive: list[int], placement, timeout_s: float) -> set[int]:
    """Kill the `hung` ranks: at once by a live rank on the same node (``Worker.end_process``: SIGKILL; Ray's kill
    of a stopped process waits ~5 s first, while every survivor waits on its sockets), then through Ray. The
    ranks whose process had exited already (a death Ray had not yet told the pings of: not a hang)."""
    calls = calls_beside(workers, placement, hung, alive, lambda w, pid, up: w.end_process.remote(pid, up))
    done = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)[0] if calls else []
    exited = set()
    for ref in done:
        try:
            if ray.get(ref) is None:
                exited.add(calls[ref])
        except RayActorError:  # the peer went too: the recovery finds it
            pass
    for r in hung:
        ray.kill(workers[r], no_restart=True)
    return exited


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


class RanksHung(StepDeadline):
    """Ranks left a ping unanswered for recovery.hang_s while the others answered (Heartbeat), or for
    recovery.ping_timeout_s while the ranks met (PingWatch)."""

    def __init__(self, ranks: list[int], waited: float, limit: str = "recovery.hang_s", others: bool = True):
        super().__init__(f"rank(s) {ranks} answered no ping within {limit}={waited:g}s"
                         f"{' while every other rank did' if others else ''}: hung")
        self.ranks = list(ranks)


class PingWatch:
    """Pings for calls that are not steps (the ranks meeting in a recovery, their ``where``): a round a second, and a
    rank up (in `up`, or once it answered one) that leaves one unanswered for recovery.ping_timeout_s is hung
    (``check`` raises RanksHung), as the recovery's own ping finds it: a rank stopped as the ranks meet (SIGSTOP, a
    frozen host) held the join for runtime.placement_timeout_s + collective_timeout_s, and every try after it as
    long (docs/findings.md). A rank still starting (a new rank of a resize: its ping waits behind its start) is not
    judged before its first answer. A ping answered by a death raises it. A threaded worker answers a ping in its
    join within milliseconds."""

    EVERY_S = 1.0

    def __init__(self, workers: list, ping_timeout_s: float, up: Iterable[int] = ()):
        self.workers, self.ping_timeout_s, self.up = workers, ping_timeout_s, set(up)
        self.refs: list = []
        self.sent = -float("inf")

    def check(self) -> None:
        now = time.monotonic()
        if self.refs:
            ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0, fetch_local=False)
            ray.get(ready)  # a rank that died raises
            answered = set(ready)
            self.up.update(r for r, ref in enumerate(self.refs) if ref in answered)
            if len(ready) < len(self.refs):
                silent = [r for r, ref in enumerate(self.refs) if ref not in answered and r in self.up]
                if silent and now - self.sent > self.ping_timeout_s:
                    raise RanksHung(silent, self.ping_timeout_s, "recovery.ping_timeout_s", others=False)
                if now - self.sent <= self.ping_timeout_s or silent:
                    return
            self.refs = []
        if now - self.sent >= self.EVERY_S:
            self.refs, self.sent = [w.ping.remote() for w in self.workers], now


def verdict(answered: dict[int, float], ranks: int, hang_s: float, excused=frozenset()) -> list[int]:
    """The ranks hung by one round of pings to `ranks` ranks, waited for `hang_s` ({rank: seconds its answer
    took} of those that answered): those that did not answer, if every other did within hang_s / 4, less the
    `excused` (whose silence proves nothing now); else []."""
    silent = [r for r in range(ranks) if r not in answered]
    if not silent or len(silent) == ranks or max(answered.values()) > hang_s / 4:
        return []
    return [r for r in silent if r not in excused]


class Heartbeat:
    """Pings for one streamed call's workers (rank order; `placement`: where each runs, {"node_id", "pid"});
    ``check`` raises RanksHung on a verdict."""

    def __init__(self, workers: list, hang_s: float, placement=()):
        self.workers, self.hang_s, self.placement = workers, hang_s, placement
        self.last = 0.0  # when the last round was sent (perf_counter)
        self.excused: set[int] = set()  # ranks never found hung by it (tracing a profile: the module's doc)

    def check(self) -> None:
        """A round of pings if the last is a quarter of hang_s old, waited for up to hang_s; raise RanksHung on its
        verdict."""
        if not self.hang_s or len(self.workers) < 2 or time.perf_counter() - self.last < self.hang_s / 4:
            return
        t0 = self.last = time.perf_counter()
        refs = [w.ping.remote() for w in self.workers]
        index = {ref: rank for rank, ref in enumerate(refs)}
        answered: dict[int, float] = {}
        pending = list(refs)
        while pending:  # each answer's time, as it comes (a dead rank's error too: raised below)
            left = self.hang_s - (time.perf_counter() - t0)
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=left, fetch_local=False)
            for ref in ready:
                answered[index[ref]] = time.perf_counter() - t0
        # A rank that died raises here (RayActorError): its peers may not notice (its sockets left open: a host
        # frozen or gone), and the call would wait for their collectives' timeout.
        ray.get([refs[r] for r in answered])
        hung = self.confirmed(verdict(answered, len(refs), self.hang_s, self.excused), answered)
        if hung:
            raise RanksHung(hung, self.hang_s)

    def confirmed(self, silent: list[int], answered: dict[int, float]) -> list[int]:
        """Of the `silent` ranks, those a rank beside each on its node that `answered` sees stopped, idle or gone
        (the module's doc; a busy one is slow, not hung), and those with no such rank (silence alone)."""
        looks = calls_beside(self.workers, self.placement, silent, answered,
                             lambda w, pid, up: w.look_at.remote(pid, self.hang_s / 4, up))
        done = ray.wait(list(looks), num_returns=len(looks), timeout=self.hang_s)[0] if looks else []
        seen = set()
        for ref in done:
            try:
                if ray.get(ref) != "busy":
                    seen.add(looks[ref])
            except RayActorError:  # the peer went: the step's error tells
                pass
        # A look not back in time gives no verdict either: the next round looks again.
        return [r for r in silent if r in seen or r not in looks.values()]


def watched_get(refs: list, workers: list, timeout_s: float, hang_s: float, placement=()) -> list:
    """ray.get of calls on `workers` (an evaluation: every rank in collectives), with a heartbeat round whenever
    a second passes without them all: a stopped rank raises RanksHung in about hang_s, not at gloo's collective
    timeout or at `timeout_s` (GetTimeoutError). A failed call's error is raised as soon as it is there."""
    return all_or_first_error(refs, timeout_s, Heartbeat(workers, hang_s, placement).check, slice_s=1.0)
