"""A streamed call of several steps on every worker, read step by step as the records arrive.

Each worker's ``run_steps`` is a Ray streaming generator: it yields each
step's record as it completes and, every ``snapshot_every`` steps on the
ranks owning the state (raytp.moves.owners), its packed state right
after it, yielded just before that step's record: a step's records read from
every rank prove its snapshot parts whole. The objects are owned by the
driver (so a snapshot outlives its worker) but stay where they were made: the
driver waits on them with ``fetch_local=False``, or every snapshot would be
pulled to the driver's node before the next step is taken.

Only the reporting ranks (``reporting_ranks``: rank 0, and the rank holding
the loss) yield a record every step, read with one ``ray.wait`` and one
``ray.get``; an owner yields one after each snapshot part. The others' streams
yield nothing: the driver reads their ends once per call, before the call's
last step counts, and looks at them between steps whenever a step takes more
than twice as long as the one before (a quiet rank's error shows there; on
gloo its peers fail at once too). Every rank's record every step cost the
driver 44 ms of CPU per step at 1024 ranks and Ray's own threads 0.2 s more
(bench/driver_scale.py): Ray handles each streamed item.

Pipelining (``StepStream.then``): submitting a call costs the driver ~0.1 ms
per rank, and Ray takes ~0.5 s to hand a call to 1024 ranks; no rank can take
the call's first collective before every rank has it. So the next call is
submitted while the current one runs, and Ray hands it to every worker during
that call. Workers are threaded actors, so each rank's part of it waits inside
the worker (raytp.runtime.worker.calls) until that rank's part of the call
before has ended, and starts at once then; if that part failed, or the rank's
process groups were torn down since (a recovery), it fails at once without
running a step. Each call carries a number (``seq``, increasing in this
process) and the one it follows (``after``). After a failure the driver
``drain``s the call behind as well: every rank's part has failed or ended by
the time its recovery has waited the survivors out.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import ray

from raytp.parallel.layout import Layout
from raytp.moves.owners import Owners
from raytp.runtime.cluster.health import Heartbeat
from raytp.runtime.errors import StepDeadline, WorkerAborted


@dataclass(frozen=True)
class StepRecords:
    """What one step of a streamed call brought: each rank's record, and the owners' snapshot parts."""
    step: int
    records: list[dict]  # the reporting ranks' (reporting_ranks), rank 0's first
    snapshot: dict[int, object]  # part (raytp.moves.owners) -> ObjectRef of its packed state after this step


_numbers = itertools.count(1)  # of the calls this process submits: a worker runs them in this order


def reporting_ranks(layout: Layout) -> list[int]:
    """The ranks whose every step's record the driver reads: rank 0 (its figures are the step's), and the
    first rank of replica 0's last stage, where the loss is (the same rank until pipeline stages)."""
    return sorted({0, layout.rank(tp=0, pp=layout.pp - 1, dp=0)})


def direct_ranks(layout: Layout) -> list[int]:
    """The ranks a call is submitted to by the driver itself, never relayed (raytp.runtime.cluster.relay):
    the reporting ranks, and the owners of the state (the driver owns their snapshot parts)."""
    return sorted(set(reporting_ranks(layout)) | set(Owners(layout).owners()))


class StepStream:
    """One streamed call of `count` steps on `workers` (rank order, of `layout`): iterate for each
    step's StepRecords. Raises StepDeadline if a step makes no progress within `timeout` seconds,
    and Ray's errors if a worker dies or aborts.
    `after`: the number (``seq``) of the call this one was submitted behind (see ``then``).
    `relay`: {leader: (peer ranks, ref of the list of their handles)}: ranks the call reaches through
    their leader (raytp.runtime.cluster.relay.relay_plan); every other rank gets it from here."""

    def __init__(self, workers, layout: Layout, start: int, count: int, snapshot_every: int, timeout: float,
                 after: int | None = None, relay: dict | None = None, hang_s: float = 0.0, placement=()):
        self.workers, self.layout, self.timeout = workers, layout, timeout
        self.heartbeat = Heartbeat(workers, hang_s, placement)  # pinged while a step runs long: a hung rank found fast
        self.start, self.count, self.snap = start, count, snapshot_every
        self.after, self.relay = after, relay or {}
        self.seq = next(_numbers)
        self.reporters, self.owners = reporting_ranks(layout), Owners(layout).owners()
        relayed = {p for peers, _ in self.relay.values() for p in peers}
        report = set(self.reporters)
        snapshots = bool(snapshot_every) and any((s + 1) % snapshot_every == 0 for s in range(start, start + count))
        yielding = report | (set(self.owners) if snapshots else set())
        self.ends = [r for r in range(len(workers)) if r not in relayed and r not in report]  # ends to read
        self.watch = [r for r in self.ends if r not in yielding]  # those whose stream yields nothing
        self.poll_s = 1.0  # then twice the time of the step before
        self.streams = {}
        for rank, w in enumerate(workers):
            if rank not in relayed:
                lead = self.relay.get(rank)
                self.streams[rank] = w.run_steps.options(num_returns="streaming").remote(
                    start, count, snapshot_every, self.seq, after, rank in report, lead[1] if lead else None)

    def excuse(self, ranks) -> None:
        """Ranks whose silence proves nothing while this call runs (tracing a profile: torch's profiler holds
        the GIL): its heartbeat never finds them hung (raytp.runtime.cluster.health)."""
        self.heartbeat.excused = set(ranks)

    def then(self, count: int, snapshot_every: int) -> "StepStream":
        """The call that follows this one on the same workers, submitted now: each rank starts it the
        moment its part of this call ends, if that part ended well (raytp.runtime.worker.calls)."""
        nxt = StepStream(self.workers, self.layout, self.start + self.count, count, snapshot_every,
                         self.timeout, after=self.seq, relay=self.relay, hang_s=self.heartbeat.hang_s,
                         placement=self.heartbeat.placement)
        nxt.poll_s = self.poll_s  # the steps' time so far (a hang in the next call's first step is found as fast)
        return nxt

    def __iter__(self):
        owners = self.owners
        t_last = time.perf_counter()
        for step in range(self.start, self.start + self.count):
            parts, readers = {}, self.reporters
            if self.snap and (step + 1) % self.snap == 0:  # the owners' snapshot parts come before the records
                parts = dict(enumerate(self._next_all([self.streams[r] for r in owners])))
                readers = sorted(set(readers) | set(owners))
            refs = self._next_all([self.streams[r] for r in readers])
            ended = [rank for rank, ref in zip(readers, refs) if ref is None]
            if ended:  # a stream ended at its snapshot part: that part is the rank's error; raise it
                errors = [parts.get(k) for k, rank in enumerate(owners) if rank in ended]
                ray.get([e for e in errors if e is not None])
                raise WorkerAborted(f"rank(s) {ended} ended their call before step {step}")
            # Raises if a rank died, also between its part and record (the survivors' records of steps
            # they finished are read back by the recovery: raytp.runtime.worker.worker.Worker.kept_records).
            got = dict(zip(readers, ray.get(refs)))
            if step == self.start + self.count - 1:
                self._ends_read()  # the call's last step counts once every rank's part ended well
            now = time.perf_counter()
            # How long a step is: the ranks' own times, not the time between yields, which counts the driver's
            # work between steps too (a spare's upkeep made it ~0.5 s, and a hang's first ping round 1 s late).
            took = [g["step_time_s"] for g in got.values() if isinstance(g, dict) and "step_time_s" in g]
            self.poll_s, t_last = max(0.2, 2 * (max(took) if took else now - t_last)), now
            yield StepRecords(step, [got[r] for r in self.reporters], parts)

    def _next_all(self, streams) -> list:
        """The next object ref of each of `streams` (one batched wait; the objects are not fetched; None
        for a stream that ended), or StepDeadline if none of those still missing comes within the timeout.
        Whenever poll_s passes without them, the streams that yield nothing are looked at (``_quiet_check``)."""
        pending, t_progress = list(streams), time.perf_counter()
        while pending:
            waited = time.perf_counter() - t_progress
            if waited >= self.timeout:
                raise StepDeadline(f"no progress within runtime.step_timeout_s={self.timeout:g}s")
            slice_s = min(self.poll_s, self.timeout - waited)
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=slice_s, fetch_local=False)
            if ready:
                t_progress = time.perf_counter()
            if pending:
                self._quiet_check(list(self.watch), 0)
                self.heartbeat.check()  # a step longer than the last ones: does every rank still answer?
        return [next(s, None) for s in streams]  # None: the stream ended

    def _quiet_check(self, ranks: list[int], timeout: float) -> None:
        """Read the ends of those of `ranks`' streams (whose next item is their end) that are there
        within `timeout`: raise the error a stream ended with; one that ended well is not read again."""
        if not ranks:
            return
        streams = [self.streams[r] for r in ranks]
        ready, _ = ray.wait(streams, num_returns=len(streams), timeout=timeout, fetch_local=False)
        done = set(ready)
        for rank, stream in zip(list(ranks), streams):
            if stream in done:
                ref = next(stream, None)
                if ref is not None:
                    ray.get(ref)  # nothing is left to yield: this is its error, raised here
                    raise WorkerAborted(f"rank {rank} yielded a record it was not asked for")
                self.ends.remove(rank)
                if rank in self.watch:
                    self.watch.remove(rank)

    def _ends_read(self) -> None:
        """Wait until every submitted rank that does not report has ended its call (a leader: with
        the ranks it relayed to); raise the error one ended with, or StepDeadline if one does not end
        within the timeout."""
        t0 = time.perf_counter()
        while self.ends:
            left = self.timeout - (time.perf_counter() - t0)
            if left <= 0:
                raise StepDeadline(f"rank(s) {self.ends[:8]} did not end their call within "
                                   f"runtime.step_timeout_s={self.timeout:g}s")
            self._quiet_check(list(self.ends), min(left, self.poll_s))
            if self.ends:
                self.heartbeat.check()

    def drain(self, timeout: float = 1.0) -> None:
        """After a failure: take what is left of every worker's stream (its records, its error), so that
        nothing is left unread for Ray to report as an unhandled error; the failure has been dealt with."""
        for stream in self.streams.values():
            while True:
                ready, _ = ray.wait([stream], timeout=timeout, fetch_local=False)
                if not ready:
                    break
                try:
                    ray.get(next(stream), timeout=timeout)
                except StopIteration:
                    break
                except Exception:  # noqa: BLE001 - the error it ended with, expected and handled
                    pass

