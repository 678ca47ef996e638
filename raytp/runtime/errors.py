"""The errors of the runtime, in a module of their own (every runtime module may import it).

``FAILURES`` are the exceptions that mean "a worker may be lost": the driver
answers them with a recovery (raytp.runtime.recovery.recovery), a resize with a
rollback. Anything else is a bug or a user error and ends the run.
"""
from __future__ import annotations

from ray.exceptions import GetTimeoutError, ObjectLostError, OwnerDiedError, RayActorError, RayTaskError


class StepDeadline(RuntimeError):
    """No worker finished a step within runtime.step_timeout_s: someone may hang."""


class JoinStuck(StepDeadline):
    """Ranks still inside a join the driver aborted (a rank lost while they met), killed: gloo retries a
    connection to a lost peer until runtime.collective_timeout_s with nothing an abort could shut."""

    def __init__(self, ranks: list[int]):
        super().__init__(f"rank(s) {ranks} were still inside the aborted join: stuck, ended")
        self.ranks = list(ranks)


class WorkerAborted(RuntimeError):
    """A rank left a step because a collective failed (raised inside the worker)."""


class RecoveryFailed(RuntimeError):
    """Workers were lost and could not be replaced or restored."""


class JobError(RuntimeError):
    """A step failed while every worker is alive: an error of the job itself (its code, its data),
    which a recovery would only repeat."""


class PlacementError(RuntimeError):
    """The cluster cannot host the layout within the timeout."""


class DoesNotFit(RuntimeError):
    """A worker's share of the job does not fit its GPU's memory (found before any shard is built)."""


FAILURES = (RayActorError, RayTaskError, GetTimeoutError, StepDeadline, ObjectLostError, OwnerDiedError)
