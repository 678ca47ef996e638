"""A running job's resizes between step boundaries, as the driver carries them.

``pending``: a requested resize whose new ranks are starting while the old
layout trains on; ``growing``: after an elastic shrink, the capacity asked
back. This object keeps only these records: every switch comes back as a
``resize.Switched`` for the driver to adopt, every answer as an Outcome.
"""
from __future__ import annotations

from raytp.runtime import resize
from raytp.runtime.records import GrowBack, Outcome, PendingResize


class Elastic:
    def __init__(self, target_dp: int, say, log):
        self.target_dp = target_dp  # an elastic job grows back to this after a shrink
        self.say, self.log = say, log
        self.pending: PendingResize | None = None
        self.growing: GrowBack | None = None

    def request(self, group, tp: int, dp: int, step: int, request_id: int | None = None):
        """Begin a resize: an Outcome (refused, trivial), a Switched (done at once), or None while
        its new ranks start (then ``due`` and ``finish`` at a step boundary)."""
        if self.pending is not None:
            new = self.pending.new_cfg.parallel
            return Outcome.refused(f"a resize to TP={new.tp} x DP={new.dp} is in progress")
        got = resize.request(group, tp, dp, step, self.say, self.log, request_id)
        if isinstance(got, PendingResize):
            self.pending = got
            return None
        return got

    def due(self, group, now: bool = False) -> bool:
        """Whether the pending resize switches at this boundary (at once if `now`, or if it has no new
        ranks to wait for: a shrink)."""
        p = self.pending
        return p is not None and (now or not p.early or resize.due(group, p))

    def finish(self, group, step: int) -> tuple[int | None, object]:
        """(the request to answer, the Switched or the Outcome of a cancelled one)."""
        p, self.pending = self.pending, None
        return p.request_id, resize.finish(group, p, step)

    def cancel(self, group, why: str) -> tuple[int | None, Outcome] | None:
        p, self.pending = self.pending, None
        return None if p is None else (p.request_id, resize.cancel(group, p, why))

    def grow(self, group, step: int):
        """A Switched once the capacity asked back is placed; None meanwhile."""
        self.growing, switched = resize.grow(group, self.growing, self.target_dp, step, self.say)
        return switched

    def release(self, group) -> tuple[int | None, Outcome] | None:
        """Drop what is in progress (the run ends): the pending request's answer, if any."""
        if self.growing is not None:
            group.placer.release(self.growing.pgs.values())
            self.growing = None
        return self.cancel(group, "the run ended")
