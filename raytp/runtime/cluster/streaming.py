"""A streamed call of several steps on every worker, read step by step as the records arrive.

Each worker's ``run_steps`` is a Ray streaming generator: it yields each
step's record as it completes and, every ``snapshot_every`` steps on DP
replica 0, its packed state right after it. The objects are owned by the
driver (so a snapshot outlives its worker) but stay where they were made: the
driver waits on them with ``fetch_local=False``, or every snapshot would be
pulled to the driver's node before the next step is taken.

A step's records are read with one ``ray.wait`` and one ``ray.get`` over all
ranks (rank by rank, three Ray calls per rank, cost 4x as much at 1024 ranks).

Pipelining (``StepStream.then``): submitting a call costs the driver ~0.3 ms
per rank, and no rank can take the call's first collective until every rank's
call is submitted. So the next call can be submitted while this one runs,
gated: its ``start`` argument is a ref that a small actor (``Gate``, one per
driver process, started with the first gated call) resolves once every rank's
current call has ended (Ray hands it the call only once their ``completed()``
refs are ready), and Ray sends an actor task only once its arguments are
ready. Workers are threaded actors and would otherwise run both calls at once.
An actor, not a task: a task would wait for a worker process at the boundary
(0.6 s the first time, measured), an actor call takes ~1 ms.
If a current call ends with a lost worker, its ``completed()`` ref holds the
error, so does the gate, and the gated calls fail without running; after any
other failure the driver ``cancel``s the gate (a task still waiting for its
arguments is never run). Either way the driver ``drain``s the gated stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray

from raytp.parallel.layout import Layout
from raytp.parallel.ownership import Ownership
from raytp.runtime.errors import StepDeadline


@dataclass(frozen=True)
class StepRecords:
    """What one step of a streamed call brought: each rank's record, and replica 0's snapshot parts."""
    step: int
    records: list[dict]
    snapshot: dict[int, object]  # tp_rank -> ObjectRef of its packed state after this step


class Gate:
    """Answers ``after`` once Ray has resolved its arguments: each rank's call before, ended."""

    async def after(self, start: int, *ended) -> int:
        return start


_gates: dict = {}  # (Ray job, this process's node) -> this process's Gate actor


def _gate():
    ctx = ray.get_runtime_context()
    key = (ctx.get_job_id(), ctx.get_node_id())  # a new Ray session may reuse the job id, never the node id
    if key not in _gates:
        _gates.clear()  # one of an earlier Ray session is gone with it
        _gates[key] = ray.remote(Gate).options(num_cpus=0, max_restarts=-1).remote()
    return _gates[key]


class StepStream:
    """One streamed call of `count` steps on `workers` (rank order, of `layout`): iterate for each
    step's StepRecords. Raises StepDeadline if a step makes no progress within `timeout` seconds,
    and Ray's errors if a worker dies or aborts. ``partial``: rank 0's record of the step in progress.
    `after`: a gate ref (see ``then``) that the calls wait for instead of starting at once."""

    def __init__(self, workers, layout: Layout, start: int, count: int, snapshot_every: int, timeout: float,
                 after=None):
        self.workers, self.layout, self.timeout = workers, layout, timeout
        self.start, self.count, self.snap = start, count, snapshot_every
        self.partial: dict | None = None
        self.gate = after
        _gate()  # started with the first call, so that it is up by the first boundary a call waits behind
        first = start if after is None else after
        self.streams = [w.run_steps.options(num_returns="streaming").remote(first, count, snapshot_every)
                        for w in workers]

    def then(self, count: int, snapshot_every: int) -> "StepStream":
        """The call that follows this one on the same workers, submitted now and started by each rank
        as soon as every rank's part of this call has ended."""
        gate = _gate().after.remote(self.start + self.count, *(s.completed() for s in self.streams))
        return StepStream(self.workers, self.layout, self.start + self.count, count, snapshot_every,
                          self.timeout, after=gate)

    def cancel(self) -> None:
        """A gated call that must not run (the call before it failed): its gate is cancelled, so that
        no rank starts it (if the gate already fired, the ranks fail it at once: their groups are gone)."""
        if self.gate is not None:
            ray.cancel(self.gate)

    def __iter__(self):
        parts_from = Ownership(self.layout).owners()
        for step in range(self.start, self.start + self.count):
            refs = self._next_all(self.streams)
            try:
                recs = ray.get(refs)
            except Exception:
                self.partial = _value_or_none(refs[0])
                raise
            self.partial = recs[0]
            parts = {}
            if self.snap and (step + 1) % self.snap == 0:
                parts = dict(enumerate(self._next_all([self.streams[r] for r in parts_from])))
            yield StepRecords(step, recs, parts)

    def _next_all(self, streams) -> list:
        """The next object ref of each of `streams` (one batched wait; the objects are not fetched), or
        StepDeadline if none of those still missing comes within the timeout."""
        pending = list(streams)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self.timeout, fetch_local=False)
            if not ready:
                raise StepDeadline(f"no progress within runtime.step_timeout_s={self.timeout:g}s")
        return [next(s) for s in streams]

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
