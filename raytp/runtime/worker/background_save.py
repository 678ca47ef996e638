"""A worker's file of one checkpoint, written by a thread of its own while training goes on.

Where the worker packed a snapshot of this very step (``recovery.snapshot_every``),
the thread writes from that copy and training never waits: the checkpoint costs
no pause and no memory beyond the snapshot's own. Otherwise it writes straight
from the live weights and AdamW state, one tensor at a time (on cuda through a
side stream into host memory, a tensor at a time): no copy of the shard is made. Training pauses only where it must: the
next step's forward and backward only read those tensors, and its optimizer
update waits until the file is written (``Worker.run_steps`` passes ``wait``
as the update's hook). So a write shorter than a forward and backward costs
nothing, and memory does not grow by the shard.
"""
from __future__ import annotations

import threading

import torch

from raytp.files import checkpoint
from raytp.files.storage import Storage


class BackgroundSave:
    def __init__(self, storage: Storage, directory: str, tensors: dict, tp_rank: int, device: torch.device,
                 staged: bool = False, then=None, tp: int = 1, stage: int | None = None, dp_rank: int = 0,
                 whole: frozenset = frozenset()):
        """`staged`: the tensors are a copy (a snapshot's buffer), not the live ones: nothing waits for
        them. `then()`: called once the file is written (or failed)."""
        self.copied = threading.Event()  # every byte handed to the file: the tensors may change again
        self.done = threading.Event()    # written and durable (or failed)
        if staged:
            self.copied.set()
        self.result: dict | None = None
        self.error: str | None = None
        stream = torch.cuda.Stream() if device.type == "cuda" else None

        def to_host(t: torch.Tensor) -> torch.Tensor:
            if stream is None:
                return t.cpu()
            with torch.cuda.stream(stream):
                out = t.to("cpu", non_blocking=True)
            stream.synchronize()
            return out

        def write() -> None:
            try:
                self.result = checkpoint.write_shard(storage, directory, tensors, tp_rank, to_host, self.copied.set,
                                                     tp=tp, stage=stage, dp_rank=dp_rank, whole=whole)
            except BaseException as e:  # noqa: BLE001 - reported to the driver by wait()
                self.error = f"{storage.url}/{directory}: rank's file not written ({type(e).__name__}: {e})"
            finally:
                self.copied.set()
                if then is not None:
                    then()
                self.done.set()

        threading.Thread(target=write, name="raytp-checkpoint-write", daemon=True).start()

    def wait(self) -> dict:
        """{"file", "bytes"} once written; raises CheckpointError if the write failed."""
        self.done.wait()
        if self.error is not None:
            raise checkpoint.CheckpointError(self.error)
        return self.result
