"""When the driver submits the next streamed call while the current one runs, as a pure decision.

Submitting a call to every rank costs the driver ~0.1 ms per rank, and Ray
~0.5 s to hand it to 1024 ranks, which the ranks would wait for between calls;
a call submitted behind the current one (raytp.runtime.cluster.streaming.StepStream.then)
reaches them while the current one runs and starts on each rank the moment
its part of the current one ends (raytp.runtime.worker.calls). The driver does
that only where nothing would happen at the boundary between them: no
evaluation or checkpoint at it, no stop, resize, grow-back or control request
waiting, and the next call inside the loop's end. A request filed while a call
runs behind another is served at the boundary after it. The snapshot interval
chosen at a boundary applies from the first call submitted after it.
"""
from __future__ import annotations

from raytp.runtime import policy


def follow_on(after: int, end: int, steps: int, steps_per_call: int, eval_every: int, save_every: int,
              saved_step: int | None, quiet: bool) -> int | None:
    """Steps of the call to submit now behind the current one, which ends at step `after`; None if the
    driver must act at that boundary first. `end`: where this loop stops; `steps`: the job's last
    step; `saved_step`: the newest checkpoint begun; `quiet`: nothing is waiting (stop, resize,
    grow-back, control requests)."""
    if not quiet or after >= end:
        return None
    if after == steps or (eval_every and after % eval_every == 0):
        return None  # an evaluation at the boundary (a worker call between the two)
    if policy.checkpoint_due(after, steps, save_every, saved_step):
        return None  # a save begins at the boundary, of the state at it
    return policy.call_length(after, end, steps_per_call, True, eval_every, save_every)


class Calls:
    """The driver's streamed calls: the one being read (``stream``) and the one submitted behind it
    (``next``), with the decision above."""

    def __init__(self):
        self.stream = None  # the streamed call in flight (raytp.runtime.cluster.streaming.StepStream)
        self.next = None    # the call submitted behind it, if any

    def begin(self, group, step: int, n: int, snap_every: int):
        """The call to read now: the one submitted behind the last, else `n` steps from `step` started."""
        self.stream, self.next = self.next, None
        if self.stream is None:
            self.stream = group.run_steps(step, n, snap_every)
        return self.stream

    def submit_next(self, cfg, end: int, saved_step: int | None, quiet: bool, snap_every: int) -> None:
        """Submit the next call behind the one being read if nothing must happen between them."""
        t = cfg.train
        follow = follow_on(self.stream.start + self.stream.count, end, t.steps, t.steps_per_call, t.eval_interval,
                           cfg.checkpoint.every, saved_step, quiet)
        if follow is not None:
            self.next = self.stream.then(follow, snap_every)

    def abandon(self) -> None:
        """A failure ended them: the call behind is let go (its ranks refuse it, or fail in it, once their
        groups go) and both have their aborted steps' errors read, so that Ray does not report them."""
        behind, self.next = self.next, None
        for stream in (self.stream, behind):
            if stream is not None:
                stream.drain()

    def forget_next(self) -> None:
        """The run ends on an exception: the workers go with it, and so does the call behind."""
        self.next = None
