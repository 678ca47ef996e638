"""A hung rank, found by what a stopped process cannot do: answer a ping.

Workers are threaded actors: a rank blocked in a collective, slow in its data, or writing a checkpoint still
answers a ping in milliseconds; a stopped process (SIGSTOP, a frozen host, a wedged driver call) answers
nothing. So while a step runs longer than the steps before it (the stream's poll interval, twice the last
step's time), the driver pings every rank of the call, at most once per ``recovery.hang_s``, and waits up to
``hang_s`` for the answers. A rank whose ping goes unanswered that long while every other rank answered, and
answered quickly (within a quarter of it: the machine and Ray are not merely slow), is declared hung
(``RanksHung``), and the recovery replaces it at once. Anything less sure gives no verdict: the step deadline
(``runtime.step_timeout_s``) and the recovery's ping (``recovery.ping_timeout_s``) stay the last resort. One
rank alone has no one to be compared with: only the deadline finds it hung.
"""
from __future__ import annotations

import time

import ray

from raytp.runtime.cluster.health import all_or_first_error
from raytp.runtime.errors import StepDeadline


class RanksHung(StepDeadline):
    """Ranks left a ping unanswered for recovery.hang_s while the others answered (Heartbeat)."""

    def __init__(self, ranks: list[int], waited: float):
        super().__init__(f"rank(s) {ranks} answered no ping within recovery.hang_s={waited:g}s while every "
                         f"other rank did: hung")
        self.ranks = list(ranks)


def verdict(answered: dict[int, float], ranks: int, hang_s: float) -> list[int]:
    """The ranks hung by one round of pings to `ranks` ranks, waited for `hang_s` ({rank: seconds its answer
    took} of those that answered): those that did not answer, if every other did within hang_s / 4; else []."""
    silent = [r for r in range(ranks) if r not in answered]
    if not silent or len(silent) == ranks or max(answered.values()) > hang_s / 4:
        return []
    return silent


class Heartbeat:
    """Pings for one streamed call's workers (rank order); ``check`` raises RanksHung on a verdict."""

    def __init__(self, workers: list, hang_s: float):
        self.workers, self.hang_s = workers, hang_s
        self.last = 0.0  # when the last round was sent (perf_counter)

    def check(self) -> None:
        """A round of pings if the last is hang_s old, waited for up to hang_s; raise RanksHung on its verdict."""
        if not self.hang_s or len(self.workers) < 2 or time.perf_counter() - self.last < self.hang_s:
            return
        t0 = self.last = time.perf_counter()
        refs = [w.ping.remote() for w in self.workers]
        index = {ref: rank for rank, ref in enumerate(refs)}
        answered: dict[int, float] = {}
        pending = list(refs)
        while pending:  # each answer's time, as it comes (a dead rank's error counts as an answer: not hung)
            left = self.hang_s - (time.perf_counter() - t0)
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=left, fetch_local=False)
            for ref in ready:
                answered[index[ref]] = time.perf_counter() - t0
        hung = verdict(answered, len(refs), self.hang_s)
        if hung:
            raise RanksHung(hung, self.hang_s)


def watched_get(refs: list, workers: list, timeout_s: float, hang_s: float) -> list:
    """ray.get of calls on `workers` (an evaluation: every rank in collectives), with a heartbeat round whenever
    a second passes without them all: a stopped rank raises RanksHung in about hang_s, not at gloo's collective
    timeout or at `timeout_s` (GetTimeoutError). A failed call's error is raised as soon as it is there."""
    return all_or_first_error(refs, timeout_s, Heartbeat(workers, hang_s).check, slice_s=1.0)
