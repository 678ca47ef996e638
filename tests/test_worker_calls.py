"""A worker's call order (raytp.runtime.worker.calls) without Ray: a call queued behind another waits for
it, starts only if it ended well at the right step with the process groups kept, and never overlaps it;
and the thread a call's steps run on hands over what it puts, then what it raises."""
import threading

import pytest

from raytp.runtime.errors import WorkerAborted
from raytp.runtime.worker.calls import Calls, on_thread

NOT_YET = 0.2  # how long a call that must wait is watched not to start


class Begin(threading.Thread):
    """`calls.begin(...)` on a thread of its own: `done` is set once it returned (`error`: what it raised)."""

    def __init__(self, calls, *args, **kw):
        super().__init__(daemon=True)
        self.calls, self.args, self.kw = calls, args, kw
        self.done, self.error = threading.Event(), None
        self.start()

    def run(self):
        try:
            self.calls.begin(*self.args, **self.kw)
        except WorkerAborted as e:
            self.error = e
        self.done.set()


def test_a_call_queued_before_the_one_it_follows_began_starts_when_that_one_ended_well():
    calls = Calls()
    queued = Begin(calls, 2, 5, after=1)  # Ray handed it over first: threaded actors keep no order
    assert not queued.done.wait(NOT_YET)
    calls.begin(1, 1)
    assert calls.busy() and not queued.done.wait(NOT_YET)
    calls.end(1, 5)
    assert queued.done.wait(10) and queued.error is None and calls.busy()
    calls.end(2, 9)
    assert not calls.busy()


@pytest.mark.parametrize("between, why", [
    (lambda c: c.end(1, None), "call 1 failed"),
    (lambda c: c.end(1, 4), "ended at step 4, not 5"),
    (lambda c: (c.end(1, 5), c.reset()), "torn down or rebuilt"),           # a recovery's leave_groups
    (lambda c: (c.reset(), c.end(1, 5)), "torn down or rebuilt"),           # left during the call
    (lambda c: (c.end(1, 5), c.begin(2, 5), c.end(2, 7)), "call 2 began"),  # another call came first
])
def test_a_call_queued_behind_one_that_did_not_end_well_fails_without_starting(between, why):
    calls = Calls()
    calls.begin(1, 1)
    between(calls)
    with pytest.raises(WorkerAborted, match=why):
        calls.begin(3, 5, after=1)
    assert not calls.busy()


def test_a_reset_fails_a_waiting_call_at_once_and_the_call_before_then_ends_badly():
    calls = Calls()
    calls.begin(1, 1)
    queued = Begin(calls, 2, 5, after=1)
    assert not queued.done.wait(NOT_YET)
    calls.reset()  # the rank left its process groups while call 1 ran
    assert queued.done.wait(10) and "torn down" in str(queued.error)
    calls.end(1, 5)
    with pytest.raises(WorkerAborted, match="torn down"):
        calls.begin(3, 5, after=1)


def test_a_call_that_follows_none_waits_until_no_call_runs():
    calls = Calls()
    calls.begin(1, 1)
    fresh = Begin(calls, 2, 3)
    assert not fresh.done.wait(NOT_YET)
    calls.end(1, None)
    assert fresh.done.wait(10) and fresh.error is None and calls.busy()


def test_on_thread_hands_over_what_it_puts_then_what_it_raises():
    def work(put):
        for i in range(5):
            put(i)
        raise WorkerAborted("left step 5")
    got = []
    with pytest.raises(WorkerAborted, match="left step 5"):
        for item in on_thread(work, "test-steps"):
            got.append(item)
    assert got == [0, 1, 2, 3, 4]
    assert list(on_thread(lambda put: put("only"), "test-steps")) == ["only"]
