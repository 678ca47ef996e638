"""A worker's streamed step calls: what a call yields, in which order, on which threads.

A streamed call (``Worker.run_steps``, called with num_returns="streaming") yields each step's record as
it completes (only on a reporting rank, `report`; the driver reads the others' ends and
errors) and, every `snapshot_every` steps on the ranks that own the state, this rank's
state right after it, followed by that step's record whether it reports or not (so a record
read means the snapshot part before it is whole, not the error of a rank that died in
between). Yielded objects are owned by the caller (the driver), so a snapshot outlives this
worker.

Calls run one at a time, in the driver's order (raytp.runtime.worker.calls): `seq` numbers
this call; `after` is the call it was submitted behind, while that one ran. It starts the
moment that call's steps end here, or fails at once, without a step, if that call failed or
this rank's process groups were torn down or rebuilt since.

A snapshot stalls nothing: steps run on a training thread of their own, while this
generator's thread packs the state into a reused host buffer and writes it to the object
store (the yield). The next step only reads the weights and optimizer state until its
optimizer update, and that update waits until the packing is done; so the copy overlaps the
next forward and backward passes.

If a collective fails (a peer died, or left one), this rank destroys its process groups,
which closes its sockets so that peers blocked on it fail too, and raises WorkerAborted.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from raytp.runtime.errors import WorkerAborted
from raytp.runtime.worker.calls import Calls, on_thread
from raytp.runtime.worker.snapshot_buffers import SnapshotBuffers
from raytp.train.shard_state import state_bytes


KEPT_RECORDS = 256  # steps whose records a rank keeps, at least: two streamed calls' (the one read, the one behind)


class StreamedCalls:
    """One worker's streamed calls: their order (``calls``), the host buffers its snapshots are packed into
    (``snap_bufs``), what the last snapshot cost (``snapshot_s``, packing and the object store write) and the
    records of its last steps (``kept``)."""

    def __init__(self, device: torch.device):
        self.calls = Calls()
        self.snap_bufs = SnapshotBuffers(device)
        self.snapshot_s: float | None = None
        self.kept: dict[int, dict] = {}

    def keep(self, step: int, record: dict, steps_per_call: int) -> None:
        """Keep step `step`'s record (and those of the last KEPT_RECORDS steps, or two calls' if more)."""
        self.kept[step] = record
        self.kept.pop(step - max(KEPT_RECORDS, 2 * steps_per_call + 2), None)

    def kept_records(self, start: int, stop: int) -> list[dict]:
        """The records kept of steps start .. stop-1, in order: a step this rank finished whose record the driver
        never read (it failed reading) is read here."""
        return [self.kept[s] for s in range(start, stop) if s in self.kept]

    def run(self, rank: int, start: int, count: int, snapshot_every: int, seq: int, after: int | None,
            report: bool, step: Callable, snapshot_state: Callable, leave: Callable):
        """Run steps start .. start+count-1 of a call numbered `seq` (`after`: the call it was submitted
        behind); a generator of what the call yields. `step(n, last)` runs step n (its update waiting for
        the snapshot buffer `last`) and returns its record; `snapshot_state()` is the live state to
        snapshot (None on a rank that owns none); `leave()` leaves the process groups after a failure."""
        self.calls.begin(seq, start, after)
        if after is None:  # else the call before ended well, and left the buffers to its last yield
            self.snap_bufs.reset()

        def loop(put) -> None:
            failure, last = None, None  # last: the buffer of the newest snapshot, maybe still packing
            try:
                for n in range(start, start + count):
                    try:
                        rec = step(n, last)
                    except Exception as e:  # noqa: BLE001 - every failure mid-step leaves the groups
                        failure = f"rank {rank} left step {n}: {type(e).__name__}: {e}"
                        break
                    state = snapshot_state() if snapshot_every and (n + 1) % snapshot_every == 0 else None
                    snapshot = state is not None
                    if snapshot:
                        last = self.snap_bufs.take(state_bytes(state))
                        put((n + 1, last, state))  # before the record: a record read proves its part
                    if report or snapshot:
                        put(rec)
                if last is not None:
                    last.packed.wait()  # the state is the snapshot's until it is copied
            except BaseException as e:  # noqa: BLE001 - reported through the stream, never lost
                failure = f"rank {rank} failed: {type(e).__name__}: {e}"
            if failure:  # outside the except block, so the failed step's frames are gone
                leave()
            self.calls.end(seq, None if failure else start + count)  # a call queued behind starts now
            if failure:
                raise WorkerAborted(failure)

        for item in on_thread(loop, f"raytp-rank{rank}-steps"):
            if isinstance(item, tuple):  # (step after, buffer, live state) of a snapshot
                at_step, buf, state = item
                t0 = time.perf_counter()
                try:
                    packed = self.snap_bufs.pack(state, buf)
                finally:
                    buf.packed.set()
                del state
                self.snap_bufs.newest = (at_step, packed, buf)
                yield packed
                self.snapshot_s = time.perf_counter() - t0  # packing and the write to the object store
                buf.free.set()  # written to the object store: the buffer may be packed again
            else:
                yield item
