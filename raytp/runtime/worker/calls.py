"""A worker's streamed calls: the order they run in, and the thread a call's steps run on.

The driver submits the next ``run_steps`` call while the current one runs
(raytp.runtime.driver.follow_on), so that Ray has handed it to every rank by the
time the current one ends: dispatching a call to 1024 ranks takes Ray ~0.5 s,
which every rank would otherwise sit idle through at each call boundary. A
worker is a threaded actor, so the queued call starts at once, on a thread of
its own; it waits here instead (``Calls.begin``) and starts the moment this
rank's part of the call before it has ended.

The driver numbers its calls (``seq``, increasing); a queued call names the
call it follows (``after``). It starts only if that call is this worker's
newest, ended without an error at the step the queued call starts at, and this
worker's process groups were neither torn down nor rebuilt since (``reset``: a
failure, a recovery, a resize). Otherwise it fails at once, without running a
step: the driver is recovering, and its steps are not the ones the run needs
next. A call that follows none waits only until no call runs: calls never overlap.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

from raytp.runtime.errors import WorkerAborted


class Calls:
    """The order of one worker's calls (thread-safe): ``begin`` before a call's first step, ``end`` after its
    last, ``reset`` when the process groups go."""

    def __init__(self):
        self._cond = threading.Condition()
        self._newest: int | None = None  # the number of the newest call begun
        self._open = False               # it runs
        self._at: int | None = None      # the step it ended at, if it ended well and no reset came since it began
        self._resets = 0                 # resets so far
        self._began = 0                  # resets before the newest call began
        self._queued: list[tuple[int, int]] = []  # (after, start) of each call waiting in begin

    def begin(self, seq: int, start: int, after: int | None = None) -> None:
        """Wait until call `seq` (from step `start`; queued behind call `after`, if given) may run, and
        mark it running; raise WorkerAborted, without marking it, if it may not."""
        with self._cond:
            if after is None:
                self._cond.wait_for(lambda: not self._open)
            else:
                resets, mine = self._resets, (after, start)
                self._queued.append(mine)
                try:
                    self._cond.wait_for(lambda: self._resets != resets or self._past(after))
                finally:
                    self._queued.remove(mine)
                if (self._newest, self._at) != mine:
                    raise WorkerAborted(f"call {seq} (steps from {start}) not started: {self._why(after, start)}")
            self._newest, self._open, self._at, self._began = seq, True, None, self._resets

    def _past(self, after: int) -> bool:
        """Whether call `after` has ended here, or a later one has begun."""
        return self._newest is not None and (self._newest > after or (self._newest == after and not self._open))

    def _why(self, after: int, start: int) -> str:
        if self._newest is not None and self._newest > after:
            return f"call {self._newest} began here after call {after}"
        if self._newest != after or self._resets != self._began:
            return "this rank's process groups were torn down or rebuilt"
        return f"call {after} failed" if self._at is None else f"call {after} ended at step {self._at}, not {start}"

    def end(self, seq: int, at: int | None) -> None:
        """Call `seq` ended: at step `at`, or with an error (None)."""
        with self._cond:
            if seq == self._newest:
                self._open = False
                self._at = at if self._resets == self._began else None
                self._cond.notify_all()

    def reset(self) -> None:
        """This worker's process groups were torn down or rebuilt: no call queued before may start."""
        with self._cond:
            self._resets += 1
            self._at = None
            self._cond.notify_all()

    def busy(self) -> bool:
        """A call runs, or one queued behind it is about to start (its call before ended well)."""
        with self._cond:
            return self._open or (self._newest, self._at) in self._queued


def on_thread(work: Callable[[Callable], None], name: str) -> Iterator:
    """Run `work(put)` on a thread of its own and yield what it puts, in order, as it comes (it may run two
    items ahead); re-raise what it raises, after what it put before."""
    out: queue.Queue = queue.Queue(maxsize=2)
    done = object()

    def run() -> None:
        try:
            work(out.put)
            out.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the reading thread, never lost
            out.put(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while (item := out.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item
    thread.join()
