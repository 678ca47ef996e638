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
