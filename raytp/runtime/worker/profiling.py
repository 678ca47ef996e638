"""Profiling on demand: torch.profiler traces of chosen steps on chosen ranks, written to the run's storage.

The driver hands a rank a ``ProfilePlan`` (the job's ``profile`` section before the first step, or what
``raytp profile`` asks for at a step boundary) through ``Worker.profile``, an actor call answered
while steps run (the worker is a threaded actor). The rank's step loop takes every step through
``StepProfiler.run``: at the first step a plan covers it starts ``torch.profiler.profile`` (CPU activity,
CUDA too on cuda; ``profile_memory`` and, on cuda, the CUDA allocator's history when the plan asks for
memory; every thread of the process, as the steps of a plan may run in several calls, each on a thread of
its own), marks each step ``raytp step <N>`` in the trace, and after the plan's last step has returned
its record (so that step's own time does not include it) stops the profiler and writes the Chrome trace
(``export_chrome_trace``) and the CUDA memory snapshot (``_dump_snapshot``) through
raytp.files.storage, the layer checkpoints use: the ranks run on other nodes than the driver. A step
that fails stops the profiler and writes nothing; the plan stays, so a replayed step is traced again.

Where the files go, under the checkpoint location (checkpoint listing and pruning look only at
``step-<8 digits>`` names, so they leave ``profiles/`` alone)::

    profiles/steps-<first>-<last>/rank<NNN>.json           (chrome://tracing, ui.perfetto.dev)
    profiles/steps-<first>-<last>/rank<NNN>-memory.pickle  (pytorch.org/memory_viz; cuda with memory)
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass

import torch

from raytp.files.storage import Storage

MEMORY_ENTRIES = 100_000  # allocator events the CUDA memory history keeps (PyTorch's suggested size)


def all_threads_config():
    """torch.profiler's experimental setting that records every thread of the process (torch >= 2.7): a
    rank's calls run their steps on a thread each (raytp.runtime.worker.calls), and a profile started on one
    and stopped on another records nothing in between without it (and its trace export crashed, measured on
    torch 2.13). Raises RuntimeError where torch lacks it."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        raise RuntimeError(f"profiling needs torch >= 2.7 (the profiler's profile_all_threads); this worker has "
                           f"torch {torch.__version__}") from None


@dataclass(frozen=True)
class ProfilePlan:
    """Trace steps first..last (both included, numbered as metrics.jsonl numbers them) into the storage at
    `url` (the checkpoint location); `memory`: record allocations too."""
    first: int
    last: int
    memory: bool
    url: str

    @property
    def folder(self) -> str:
        return profile_dir(self.first, self.last)

    def covers(self, step: int) -> bool:
        return self.first <= step <= self.last


def profile_dir(first: int, last: int) -> str:
    """The folder of one profile's files, relative to the checkpoint location."""
    return f"profiles/steps-{first}-{last}"


def trace_file(rank: int) -> str:
    return f"rank{rank:03d}.json"


def memory_file(rank: int) -> str:
    return f"rank{rank:03d}-memory.pickle"


class StepProfiler:
    """One rank's plans and the profile running, if any. ``add`` is called from an actor thread, ``run``
    from the step loop's."""

    def __init__(self):
        self.lock = threading.Lock()
        self.plans: list[ProfilePlan] = []
        self.active: tuple[ProfilePlan, torch.profiler.profile] | None = None

    def add(self, plan: ProfilePlan) -> None:
        all_threads_config()  # refused here, at the request, where torch cannot
        with self.lock:
            self.plans = [p for p in self.plans if p != plan] + [plan]

    def run(self, step: int, rank: int, device: torch.device, body):
        """`body()` (the step, returning its record), traced if a plan covers `step`."""
        if self.active is None:
            self._start(step, device)
        if self.active is None:
            return body()
        plan, prof = self.active
        try:
            with torch.profiler.record_function(f"raytp step {step}"):
                record = body()
        except BaseException:
            self._stop(device)  # nothing written: the step is replayed (traced again) or the run ends
            raise
        if step >= plan.last:
            self._stop(device, plan, rank)
        return record

    def _start(self, step: int, device: torch.device) -> None:
        with self.lock:
            self.plans = [p for p in self.plans if p.last >= step]  # a resumed run may start past a plan
            plan = next((p for p in self.plans if p.covers(step)), None)
        if plan is None:
            return
        cuda = device.type == "cuda"
        if cuda and plan.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES, clear_history=True)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        prof = torch.profiler.profile(activities=activities, profile_memory=plan.memory,
                                      experimental_config=all_threads_config())
        prof.start()
        self.active = (plan, prof)

    def _stop(self, device: torch.device, done: ProfilePlan | None = None, rank: int = 0) -> None:
        """Stop the running profile; with `done`, write its files for `rank` and forget that plan."""
        plan, prof = self.active
        self.active = None
        memory = device.type == "cuda" and plan.memory
        try:
            prof.stop()
            if done is not None:
                write_profile(prof, done, rank, memory)
        except Exception as e:  # noqa: BLE001 - a profile that cannot be written never stops the training
            print(f"[raytp] rank {rank}: the profile of steps {plan.first}-{plan.last} was not written: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            if memory:
                torch.cuda.memory._record_memory_history(enabled=None)
            if done is not None:
                with self.lock:
                    self.plans = [p for p in self.plans if p != done]


def write_profile(prof: torch.profiler.profile, plan: ProfilePlan, rank: int, memory: bool) -> None:
    """The Chrome trace (and with `memory` the CUDA memory snapshot) of a stopped profile, written to a
    local temporary file each, as torch writes them, then copied to the plan's storage."""
    storage = Storage(plan.url)
    with tempfile.TemporaryDirectory(prefix="raytp-profile-") as tmp:
        local = os.path.join(tmp, trace_file(rank))
        prof.export_chrome_trace(local)
        _upload(storage, local, f"{plan.folder}/{trace_file(rank)}")
        if memory:
            local = os.path.join(tmp, memory_file(rank))
            torch.cuda.memory._dump_snapshot(local)
            _upload(storage, local, f"{plan.folder}/{memory_file(rank)}")


def _upload(storage: Storage, local: str, rel: str) -> None:
    with open(local, "rb") as src, storage.open_write(rel) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
