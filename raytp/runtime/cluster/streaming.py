"""A streamed call of several steps on every worker, read step by step as the records arrive.

Each worker's ``run_steps`` is a Ray streaming generator: it yields each
step's record as it completes and, every ``snapshot_every`` steps on the
ranks owning the state (raytp.parallel.ownership), its packed state right
after it, yielded just before that step's record: a step's records read from
every rank prove its snapshot parts whole. The objects are owned by the
driver (so a snapshot outlives its worker) but stay where they were made: the
driver waits on them with ``fetch_local=False``, or every snapshot would be
pulled to the driver's node before the next step is taken.

A step's records are read with one ``ray.wait`` and one ``ray.get`` over all
ranks (rank by rank, three Ray calls per rank, cost 4x as much at 1024 ranks).

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
from dataclasses import dataclass

import ray

from raytp.parallel.layout import Layout
from raytp.parallel.ownership import Ownership
from raytp.runtime.errors import StepDeadline, WorkerAborted


@dataclass(frozen=True)
class StepRecords:
    """What one step of a streamed call brought: each rank's record, and the owners' snapshot parts."""
    step: int
    records: list[dict]
    snapshot: dict[int, object]  # part (raytp.parallel.ownership) -> ObjectRef of its packed state after this step


_numbers = itertools.count(1)  # of the calls this process submits: a worker runs them in this order


class StepStream:
    """One streamed call of `count` steps on `workers` (rank order, of `layout`): iterate for each
    step's StepRecords. Raises StepDeadline if a step makes no progress within `timeout` seconds,
    and Ray's errors if a worker dies or aborts. ``partial``: rank 0's record of the step in progress.
    `after`: the number (``seq``) of the call this one was submitted behind (see ``then``)."""

    def __init__(self, workers, layout: Layout, start: int, count: int, snapshot_every: int, timeout: float,
                 after: int | None = None):
        self.workers, self.layout, self.timeout = workers, layout, timeout
        self.start, self.count, self.snap = start, count, snapshot_every
        self.partial: dict | None = None
        self.seq = next(_numbers)
        self.streams = [w.run_steps.options(num_returns="streaming").remote(start, count, snapshot_every,
                                                                            self.seq, after)
                        for w in workers]

    def then(self, count: int, snapshot_every: int) -> "StepStream":
        """The call that follows this one on the same workers, submitted now: each rank starts it the
        moment its part of this call ends, if that part ended well (raytp.runtime.worker.calls)."""
        return StepStream(self.workers, self.layout, self.start + self.count, count, snapshot_every,
                          self.timeout, after=self.seq)

    def __iter__(self):
        parts_from = Ownership(self.layout).owners()
        for step in range(self.start, self.start + self.count):
            parts = {}
            if self.snap and (step + 1) % self.snap == 0:  # the owners' snapshot parts come before the records
                parts = dict(enumerate(self._next_all([self.streams[r] for r in parts_from])))
            refs = self._next_all(self.streams)
            ended = [rank for rank, ref in enumerate(refs) if ref is None]
            if ended:  # a stream ended at its snapshot part: that part is the rank's error; raise it
                errors = [parts.get(k) for k, rank in enumerate(parts_from) if rank in ended]
                ray.get([e for e in errors if e is not None])
                raise WorkerAborted(f"rank(s) {ended} ended their call before step {step}")
            try:
                recs = ray.get(refs)  # raises if a rank died, also between its part and its record
            except Exception:
                self.partial = _value_or_none(refs[0])
                raise
            self.partial = recs[0]
            yield StepRecords(step, recs, parts)

    def _next_all(self, streams) -> list:
        """The next object ref of each of `streams` (one batched wait; the objects are not fetched; None
        for a stream that ended), or StepDeadline if none of those still missing comes within the timeout."""
        pending = list(streams)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self.timeout, fetch_local=False)
            if not ready:
                raise StepDeadline(f"no progress within runtime.step_timeout_s={self.timeout:g}s")
        return [next(s, None) for s in streams]  # None: the stream ended

    def drain(self, timeout: float = 1.0) -> None:
        """After a failure: take what is left of every worker's stream (its records, its error), so that
        nothing is left unread for Ray to report as an unhandled error; the failure has been dealt with."""
        for stream in self.streams:
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


def _value_or_none(ref):
    try:
        return ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001 - rank 0 has no record of this step
        return None
