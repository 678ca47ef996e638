"""A streamed call of several steps on every worker, read step by step as the records arrive.

Each worker's ``run_steps`` is a Ray streaming generator: it yields each
step's record as it completes and, every ``snapshot_every`` steps on DP
replica 0, its packed state right after it. The objects are owned by the
driver (so a snapshot outlives its worker) but stay where they were made: the
driver waits on them with ``fetch_local=False``, or every snapshot would be
pulled to the driver's node before the next step is taken.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray

from raytp.parallel.layout import Layout
from raytp.runtime.errors import StepDeadline


@dataclass(frozen=True)
class StepRecords:
    """What one step of a streamed call brought: each rank's record, and replica 0's snapshot parts."""
    step: int
    records: list[dict]
    snapshot: dict[int, object]  # tp_rank -> ObjectRef of its packed state after this step


class StepStream:
    """One streamed call of `count` steps on `workers` (rank order, of `layout`): iterate for each
    step's StepRecords. Raises StepDeadline if a step makes no progress within `timeout` seconds,
    and Ray's errors if a worker dies or aborts. ``partial``: rank 0's record of the step in progress."""

    def __init__(self, workers, layout: Layout, start: int, count: int, snapshot_every: int, timeout: float):
        self.layout, self.start, self.count, self.snap, self.timeout = layout, start, count, snapshot_every, timeout
        self.partial: dict | None = None
        self.streams = [w.run_steps.options(num_returns="streaming").remote(start, count, snapshot_every)
                        for w in workers]

    def __iter__(self):
        lay, timeout = self.layout, self.timeout
        for step in range(self.start, self.start + self.count):
            recs, parts = [], {}
            for rank, stream in enumerate(self.streams):
                recs.append(ray.get(_next(stream, timeout)))
                self.partial = recs[0]
                dp_rank, tp_rank = lay.coords(rank)
                if self.snap and dp_rank == 0 and (step + 1) % self.snap == 0:
                    parts[tp_rank] = _next(stream, timeout)
            yield StepRecords(step, recs, parts)


    def drain(self, timeout: float = 1.0) -> None:
        """After a failure: take what is left of every worker's stream (its records, its error), so that
        nothing is left unread for Ray to report as an unhandled error; the failure has been dealt with."""
        for stream in self.streams:
            deadline = timeout
            while True:
                ready, _ = ray.wait([stream], timeout=deadline, fetch_local=False)
                if not ready:
                    break
                try:
                    ray.get(next(stream), timeout=deadline)
                except StopIteration:
                    break
                except Exception:  # noqa: BLE001 - the error it ended with, expected and handled
                    pass


def _next(stream, timeout: float):
    """The next object of a streaming call, or StepDeadline if none comes within `timeout`. The object
    stays where it was made: fetch_local=False, or every snapshot would be pulled to the driver's
    node before the next step is taken (a full model's state per step, over the network)."""
    ready, _ = ray.wait([stream], timeout=timeout, fetch_local=False)
    if not ready:
        raise StepDeadline(f"no progress within runtime.step_timeout_s={timeout:g}s")
    return next(stream)
