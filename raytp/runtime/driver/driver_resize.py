"""The Driver's resizes: requested, switched to at a step boundary, adopted (a part of
raytp.runtime.driver.driver.Driver, kept apart: the Driver class mixes it in and owns every attribute it
reads; raytp.runtime.elastic.resize.Elastic keeps the records and carries the switches out)."""
from __future__ import annotations

from raytp.runtime.elastic import resize
from raytp.runtime.records import Outcome, State


class DriverResize:
    @property
    def pending_resize(self):
        return self.elastic.pending

    def resize(self, tp: int, dp: int, pp: int | None = None) -> Outcome:
        """Move to layout tp x pp x dp now: request, wait for the new ranks, switch (tests, benchmarks)."""
        outcome = self.request_resize(tp, dp, pp=pp)
        if outcome is None:
            self.group.answered(self.elastic.pending.ready, timeout_s=self.cfg.runtime.placement_timeout_s)
            outcome = self.advance_resize(now=True)
        return outcome

    def request_resize(self, tp: int, dp: int, request_id: int | None = None, pp: int | None = None) -> Outcome | None:
        """Begin a resize; its outcome, or None while its new ranks start (`request_id` is answered when
        it finishes). One with nothing to start (a shrink) switches at once."""
        got = self._take(self.elastic.request(self.group, tp, dp, self.step, request_id, pp))
        return self.advance_resize() if got is None and self.elastic.due(self.group) else got

    def advance_resize(self, now: bool = False) -> Outcome | None:
        """At a step boundary: switch to the pending layout if it is due (or `now`)."""
        if not self.elastic.due(self.group, now):
            return None
        self.state = State.RESIZING
        self.publish()
        request_id, got = self.elastic.finish(self.group, self.step)
        outcome = self._take(got)
        self.state = State.RUNNING
        self._answer(request_id, outcome)
        return outcome

    def _take(self, got):
        """Adopt the group of a switch (resize.Switched); the outcome. A requested DP degree is the one an
        elastic job grows back to from then on (not the one it started at)."""
        if isinstance(got, resize.Switched):
            self.adopt(got.group)
            self.resizing = got.resizing or self.resizing
            if got.resizing is not None and got.resizing.reason.startswith("requested"):
                self.elastic.target_dp = got.group.layout.dp
            return got.outcome
        return got
