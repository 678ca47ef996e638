"""Process-level settings of a worker (the C library's allocator, torch's threads, its device), made once when
it starts."""
from __future__ import annotations

import ctypes
import importlib

import torch

from raytp.train.efficiency import peak_tflops


def prepare(cfg) -> tuple[torch.device, float | None]:
    """Set up this worker's process for job `cfg`: the allocator, torch's threads, and with activation
    checkpointing (whose recomputation imports torch._dynamo: ~1.2 s) that import, paid here: a spare, or a rank
    started ahead of a resize, has it behind it when it is needed (the optimizer needs none:
    raytp.eager_adamw). Its device (Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU, then cuda:0) and that device's
    peak TFLOP/s (None where unknown)."""
    tune_malloc()
    if cfg.runtime.threads_per_worker:
        torch.set_num_threads(cfg.runtime.threads_per_worker)
    device = torch.device("cuda", 0) if cfg.runtime.device == "cuda" else torch.device("cpu")
    if cfg.train.activation_checkpointing:
        importlib.import_module("torch._dynamo")
    return device, peak_tflops(torch.cuda.get_device_name(0) if device.type == "cuda" else None,
                               cfg.runtime.peak_tflops)


def tune_malloc() -> None:
    """glibc's allocator, set for a process whose big tensors come and go from several threads (steps run
    on a thread of their own, snapshots and checkpoint files on others): blocks of 1 MiB and more are
    mapped and unmapped (a freed gradient or temporary goes back to the OS, not to a thread's arena to
    linger), and at most two arenas. Measured: a step's peak resident memory grew 1.31x -> 1.15x the
    state on a thread per call (bench/memory_scale). A no-op where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-8, 2)        # M_ARENA_MAX
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixed: no dynamic raising)
    except (OSError, AttributeError):
        pass


def thread_stacks() -> dict[str, str]:
    """{thread name: its Python stack, innermost call last} of this process now: where a rank that does not leave
    a failed step is (a threaded actor answers while its step thread is blocked)."""
    import sys
    import threading
    import traceback
    names = {t.ident: t.name for t in threading.enumerate()}
    return {names.get(ident, str(ident)): "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()}
