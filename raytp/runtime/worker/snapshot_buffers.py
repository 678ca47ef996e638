"""The two reused host buffers a worker packs its snapshots into (pinned on cuda).

A snapshot is packed into one flat buffer (raytp.train.shard_state.pack_state),
which the worker's stream then writes to the object store. Fresh buffers each
time cost page faults worth as much as the copy itself, so two are kept and
reused: one may be written out while the next is packed. Each buffer says when
it is ``packed`` (the next optimizer update waits for that: until then the
weights and AdamW state are only read) and ``free`` (written out; it may be
packed again).
"""
from __future__ import annotations

import threading

import torch

from raytp.train.shard_state import pack_state


class SnapshotBuffer:
    def __init__(self, data: torch.Tensor):
        self.data = data
        self.packed, self.free = threading.Event(), threading.Event()
        self.packed.set()
        self.free.set()
        self.held = False  # a checkpoint's file is being written from it: free once that is done


class SnapshotBuffers:
    def __init__(self, device: torch.device):
        self.device = device
        self.bufs: list[SnapshotBuffer] = []
        self.next = 0
        self.copy_stream = None  # cuda: where snapshots are copied to the host
        self.newest: tuple | None = None  # (step, packed, buffer) of the newest snapshot packed

    def hold(self, step: int):
        """The packed state of the snapshot after `step`, if it is the newest, kept from reuse until
        `release` (a checkpoint written from it); else None."""
        if self.newest is None or self.newest[0] != step:
            return None
        _, packed, buf = self.newest
        buf.free.wait()  # written to the object store
        buf.free.clear()
        buf.held = True
        return packed, buf

    @staticmethod
    def release(buf: SnapshotBuffer) -> None:
        buf.held = False
        buf.free.set()

    def reset(self) -> None:
        """Mark every buffer packed and free (a previous call that ended early may have left one in use)."""
        for buf in self.bufs:
            if not buf.held:
                buf.free.set()
            buf.packed.set()

    def take(self, nbytes: int) -> SnapshotBuffer:
        """The next buffer for a snapshot of `nbytes`, once what was packed into it two snapshots ago
        is written out (with a bounded queue it normally is)."""
        if not self.bufs or self.bufs[0].data.numel() != nbytes:  # first use, or a new shape
            for old in self.bufs:
                old.free.wait()
            pin = self.device.type == "cuda"
            self.bufs = [SnapshotBuffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)) for _ in range(2)]
        buf = self.bufs[self.next]
        self.next ^= 1
        buf.free.wait()
        buf.free.clear()
        buf.packed.clear()
        return buf

    def pack(self, state: dict, buf: SnapshotBuffer) -> dict:
        """A live_state packed into `buf` (on a side stream on cuda, finished when it returns)."""
        if self.device.type != "cuda":
            return pack_state(state, out=buf.data)
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream()
        with torch.cuda.stream(self.copy_stream):  # the step synchronized the device: the state is final
            return pack_state(state, out=buf.data)
