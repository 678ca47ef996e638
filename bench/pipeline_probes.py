"""What bench/pipeline.py measures a pipeline stage with: its busy periods and its saved activations.

``BusyPipeline`` is raytp's PipelineSchedule timing the stage's forwards and backwards (the compute;
everything else in the schedule, waiting for a neighbour included, is idle); ``one_f_one_b_idle`` is
the idle the 1F1B table itself makes of given stage times, to hold the measured idle against (the
formula (p-1)/(m+p-1) assumes equal stages). ``SavedActivations``
counts the bytes autograd keeps for backward (``torch.autograd.graph.saved_tensors_hooks``), each
storage once and the parameters left out, from the moment a tensor is saved until backward has used it
and autograd drops it: the activation memory of a schedule, without a memory profiler.
"""
from __future__ import annotations

import time
import weakref

import torch

from raytp.parallel.pipeline.pp_schedule import one_f_one_b
from raytp.train.stage_runner import PipelineSchedule


class BusyPipeline(PipelineSchedule):
    """PipelineSchedule that times its busy periods: the model's forwards (hooks) and the backwards
    (``Tensor.backward``, wrapped while the schedule runs). After a step: ``busy`` (wall seconds inside
    them), ``forward`` (the forwards' part of it), ``busy_cpu`` (this thread's CPU seconds inside them:
    less than ``busy`` when other programs took the core meanwhile) and ``span``: the schedule's (start,
    end) on CLOCK_MONOTONIC, one clock for every process."""

    def __call__(self, model, micro_batches, groups, step, h):
        self.busy = self.forward = self.busy_cpu = 0.0
        started = []

        def begin():
            started.append((time.perf_counter(), time.thread_time()))

        def end(forward: bool):
            wall, cpu = started.pop()
            seconds = time.perf_counter() - wall
            self.busy += seconds
            self.forward += seconds if forward else 0.0
            self.busy_cpu += time.thread_time() - cpu

        backward = torch.Tensor.backward

        def timed_backward(t, *args, **kwargs):
            begin()
            try:
                return backward(t, *args, **kwargs)
            finally:
                end(forward=False)

        hooks = [model.register_forward_pre_hook(lambda *_: begin()),
                 model.register_forward_hook(lambda *_: end(forward=True))]
        torch.Tensor.backward = timed_backward
        t0 = time.perf_counter()  # CLOCK_MONOTONIC on Linux
        try:
            return super().__call__(model, micro_batches, groups, step, h)
        finally:
            self.span = (t0, time.perf_counter())
            torch.Tensor.backward = backward
            for hook in hooks:
                hook.remove()


def one_f_one_b_idle(t_f: tuple[float, ...], t_b: tuple[float, ...], m: int) -> list[float]:
    """Each stage's idle share of a step of raytp's 1F1B table (p = len(t_f) stages, m micro-batches) when
    stage s takes t_f[s] and t_b[s] for a micro-batch's forward and backward and nothing else costs time:
    raytp.parallel.pipeline.pp_schedule.simulate's model with a time per stage. Equal stages give (p-1)/(m+p-1);
    unequal ones idle more, and differently on each stage."""
    p = len(t_f)
    table, done, free, pos = one_f_one_b(p, m), {}, [0.0] * p, [0] * p
    while any(pos[s] < len(table[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(table[s]):
                a = table[s][pos[s]]
                if a.kind == "F":
                    need = ("F", a.mb, s - 1) if s > 0 else None
                else:
                    need = ("B", a.mb, s + 1) if s < p - 1 else ("F", a.mb, s)
                if need is not None and need not in done:
                    break  # its input is not there yet: another stage goes on (the table cannot deadlock)
                start = max(free[s], done[need] if need else 0.0)
                free[s] = done[(a.kind, a.mb, s)] = start + (t_f[s] if a.kind == "F" else t_b[s])
                pos[s] += 1
    span = max(free)
    return [1 - m * (t_f[s] + t_b[s]) / span for s in range(p)]


class SavedActivations:
    """While active: the bytes of the tensors autograd saves for backward that are alive, each storage once,
    the model's parameters left out; ``peak`` over the time active and ``first_forward``: the bytes alive
    right after the model's first forward (one micro-batch)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.params = model, {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved tensors holding it]
        self.now = self.peak = 0
        self.first_forward: int | None = None

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self.params:
            return t
        entry = self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        holder = _Held(t)
        weakref.finalize(holder, self._release, key)  # autograd drops it once backward has used it
        return holder

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def _after_forward(self, mod, args, out):
        if self.first_forward is None:
            self.first_forward = self.now

    def __enter__(self):
        self.hook = self.model.register_forward_hook(self._after_forward)
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.t if isinstance(h, _Held) else h)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
        self.hook.remove()


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t
