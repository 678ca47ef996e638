"""The worker group a job runs on, and every change of it: a recovery, a resize, a grow-back, a move.

Each change is worked out by its own executor: raytp.runtime.recovery.recovery (a worker died or hung),
raytp.runtime.elastic.resize's ``Elastic`` (a requested layout, an elastic grow-back), and
raytp.runtime.recovery.respread's ``Respread`` (a copy moved off its twin's node, a drained node's replicas
dropped). Each hands back the next group and what the change took. ``GroupChanges`` is the one place that
takes it: the job's group, its snapshots (of no use across layouts) and the record of the change that the
next completed step closes (healing, resizing, moving) change here and nowhere else. The Driver asks it at
step boundaries, after a failed call, and for the control requests that change the layout.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from raytp.parallel.layout import Layout
from raytp.runtime.driver import reporting
from raytp.runtime.elastic import resize
from raytp.runtime.elastic.resize import Elastic
from raytp.runtime.errors import FAILURES
from raytp.runtime.records import Outcome, State
from raytp.runtime.recovery import recovery
from raytp.runtime.recovery.respread import Respread
from raytp.runtime.state.snapshots import Snapshots
from raytp.files.checkpoint import CheckpointError


class GroupChanges:
    def __init__(self, job, run: str, log, say: Callable[[str], None], *, spares, copy, checkpoints, cadence,
                 calls, show: Callable[[State], None], answer: Callable[[int | None, Outcome | None], None]):
        """`show(state)`: the driver's state while a change is carried out (published); `answer(id, outcome)`:
        a control request's answer; `calls`: the streamed calls (abandoned by a recovery); `cadence`,
        `copy`: where the snapshots' off-node copy is (for the survival line after a move)."""
        self.log, self.say, self.spares, self.copy, self.checkpoints = log, say, spares, copy, checkpoints
        self.cadence, self.calls, self.show, self.answer = cadence, calls, show, answer
        self.group = None
        self.snapshots = Snapshots(job.layout)
        self.failures = 0              # worker losses so far
        self.healing = None            # records.Healing, until the next completed step
        self.resizing = None           # records.Resizing, until the next completed step
        self.moving = None             # records.Moving, until the next completed step
        self.before: float | None = None  # the time of the last completed step (a change's `before`)
        self.elastic = Elastic(job.parallel.max_dp or job.parallel.dp, say, log)
        self.respread = Respread(run, log, say)  # copies moved off their twins' nodes

    def adopt(self, group) -> None:
        """Switch the job to `group`: the one place the workers, their layout, config and placement change."""
        old = self.group
        if old is not None and group.layout != old.layout:
            self.snapshots = Snapshots(group.layout)  # snapshots of another layout are of no use
        self.group = group
        if group.placement and (old is None or group.placement != old.placement):
            self.log.event("placed", ranks=list(group.placement))

    def closed(self, step: int, last: dict) -> None:
        """A step completed (`last`: its metrics line): log how long the change before it took, if any."""
        reporting.closed(self.log, self.say, self.healing, self.resizing, step, last, self.moving)
        self.healing = self.resizing = self.moving = None
        self.before = last.get("time")

    def survival(self) -> None:
        reporting.survival(self.log, self.say, self.group.layout, self.group.nodes(), self.group.placement,
                           self.copy.node if self.cadence.every else None)

    # -- at a step boundary ------------------------------------------------------------------------
    def boundary(self, step: int) -> int:
        """What is due between two calls: a resize whose ranks are ready, a grow-back, a move off a twin's
        node. The step to go on from (a failure during a move is recovered from)."""
        self.advance(step)
        self.take(self.elastic.grow(self.group, step))
        moved = self.respread.advance(self.group, step)
        if moved is None:
            return step
        self.adopt(moved.group)
        if moved.error is not None:
            return self.recover(moved.error, step)
        if moved.resizing is not None:  # a shrink off a drained node
            self.resizing = dataclasses.replace(moved.resizing, before=self.before)
        else:
            self.moving = dataclasses.replace(moved.moving, before=self.before)
        self.survival()
        return step

    def recover(self, error: BaseException, step: int) -> int:
        """Heal the group after `error` at `step` (the first step whose record was not read); the step training
        goes on from. Raises the recovery's error when it gives up."""
        self.show(State.RECOVERING)
        try:
            self.checkpoints.poll(self.group)  # a save every rank finished is still committed
        except FAILURES + (CheckpointError,):
            pass
        self.checkpoints.drop()
        ctx = recovery.RecoveryContext(self.log, self.say, self.spares, self.snapshots, self.copy, self.checkpoints)
        r = recovery.recover(ctx, self.group, error, step, self.failures)
        if isinstance(r, recovery.GaveUp):
            self.adopt(r.group)  # so that release() finds every actor the recovery started
            raise r.error
        self.calls.abandon()
        self.failures += r.failures
        reporting.unread_steps(self.log, r.replayed, step, r.step, self.group.cfg, self.group.layout)
        self.adopt(r.group)
        self.healing = dataclasses.replace(r.healing, before=self.before)  # the pause counts from that step
        if r.resizing is not None:
            self.resizing = dataclasses.replace(r.resizing, before=self.before)
            self.say(f"no capacity for the lost workers: continuing at {self.group.layout} (grows back to "
                     f"DP={self.elastic.target_dp} when capacity returns)")
        self.show(State.RUNNING)
        return r.step

    # -- layout changes asked for (raytp scale, Driver.resize) ---------------------------------------
    def request(self, target: Layout, step: int, request_id: int | None = None) -> Outcome | None:
        """Begin a resize to `target`; its outcome, or None while its new ranks start (`request_id` is
        answered when it finishes). One with nothing to start (a shrink) switches at once."""
        got = self.take(self.elastic.request(self.group, target, step, request_id))
        return self.advance(step) if got is None and self.elastic.due(self.group) else got

    def advance(self, step: int, now: bool = False) -> Outcome | None:
        """Look again for room for a request waiting for it; switch to the pending layout if it is due (or
        `now`)."""
        retried = self.elastic.retry(self.group, step)
        if retried is not None:  # answered now (refused, or switched at once)
            outcome = self.take(retried[1])
            self.answer(retried[0], outcome)
            return outcome
        if not self.elastic.due(self.group, now):
            return None
        self.show(State.RESIZING)
        self.settle_save()
        request_id, got = self.elastic.finish(self.group, step)
        outcome = self.take(got)
        self.show(State.RUNNING)
        self.answer(request_id, outcome)
        return outcome

    def settle_save(self) -> None:
        """Commit the checkpoint still being written before a switch stops or reshapes its writers: their
        `save_result` calls would end with them (ActorDiedError, and no checkpoint of that step). A writer lost
        meanwhile drops it; the switch, or the next step, finds the loss."""
        try:
            self.checkpoints.finish(self.group)
        except FAILURES + (CheckpointError,) as e:
            self.say(f"the checkpoint being written was lost before the resize ({type(e).__name__})")
            self.checkpoints.drop()

    def resize_now(self, step: int, timeout_s: float, **degrees) -> Outcome:
        """Request a resize to the layout with these degrees and wait until it is done: its room, its new ranks,
        the switch (tests, benchmarks; a control request is advanced at step boundaries instead). Degrees no
        layout has are refused, as a control request's are."""
        try:
            target = self.group.layout.changed(**degrees)
        except ValueError as e:
            return Outcome.refused(str(e))
        outcome = self.request(target, step)
        while outcome is None and self.elastic.awaiting is not None:  # no room yet: wait for it here
            time.sleep(0.2)
            outcome = self.advance(step)
        if outcome is None:
            self.group.answered(self.elastic.pending.ready, timeout_s=timeout_s)
            outcome = self.advance(step, now=True)
        return outcome

    def quiet(self) -> bool:
        """Nothing of this is due at the next step boundary (the next call may be submitted behind this one)."""
        e = self.elastic
        return e.pending is None and e.growing is None and e.awaiting is None and not self.respread.under_way

    def take(self, got):
        """Adopt the group of a switch (resize.Switched); the outcome. A requested DP degree is the one an
        elastic job grows back to from then on (not the one it started at)."""
        if not isinstance(got, resize.Switched):
            return got
        self.adopt(got.group)
        if got.resizing is not None:
            self.resizing = dataclasses.replace(got.resizing, before=self.before)
        if got.resizing is not None and got.resizing.reason.startswith("requested"):
            self.elastic.target_dp = got.group.layout.dp
        return got.outcome

    def release(self) -> None:
        """The requests still waiting are answered; the copies asked for by moves go."""
        if self.group is not None:
            self.answer(*(self.elastic.release(self.group) or (None, None)))
            self.respread.release(self.group)
