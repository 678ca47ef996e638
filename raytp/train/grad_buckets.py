"""A shard's gradients summed over its data-parallel replicas in flat buckets, overlapping the backward pass.

Each bucket of the plan (raytp.parallel.zero_plan) is laid out flat, DP rank
after DP rank (each rank's rows padded to the bucket's chunk), and summed over
the DP group in place: all of it, or only each rank's own chunk under the
distributed optimizer (raytp.parallel.comm.start_reduce).

A bucket is *launched* (its gradients copied into its buffer, its reduction
started asynchronously) as soon as every gradient in it is final for the step.
With ``arm`` (Megatron's ``overlap_grad_reduce``) that is decided by a hook that
fires after each parameter's gradient accumulates: on its `backwards`-th
accumulation of the step (the last micro-batch's backward), the bucket's count
of pending parameters drops, and the last one launches it while the backward
pass goes on with the layers before. Buckets not launched by then (none armed,
``hold``, or a parameter that got no gradient) are launched by ``finish``, in
bucket order, which then waits on every bucket. Every DP replica runs the same
graph, so all launch their buckets in the same order, and the buffers, their
layout and the collectives are the same with or without overlap: the result
is the same to the bit.

When scattering (the distributed optimizer), a parameter's ``.grad`` is dropped
once copied into its bucket's buffer: from then on the buffer is the gradient
(the optimizer reads its own chunk of it), so a rank never holds both, and the
next backward pass makes ``.grad`` again.

The hooks are registered once per plan and do nothing while not armed (an
evaluation, a step without overlap).
"""
from __future__ import annotations

import functools
import time

import torch

from raytp.parallel import comm
from raytp.parallel.zero_plan import Bucket


class GradBuckets:
    """The DP reduction of one shard's gradients (`params`, in plan order) over the buckets `buckets`."""

    def __init__(self, params: list[torch.Tensor], buckets: list[Bucket], scatter: bool):
        self.params, self.buckets, self.scatter = params, buckets, scatter
        self.bucket_of = {i: k for k, b in enumerate(buckets) for i in b.params}
        self._hooks: list = []
        self._armed = None  # (group, backwards) while an armed step's backward runs
        self.early = 0  # buckets the last finished step launched from its backward pass
        self.finish_s = 0.0  # seconds its ``finish`` took: the DP reduction the backward pass did not hide
        self._reset()

    def _reset(self) -> None:
        self._count = [0] * len(self.params)       # accumulations this step, per parameter
        self._left = [len(b.params) for b in self.buckets]  # parameters whose gradient is not final yet
        self._started: dict[int, tuple[torch.Tensor, object]] = {}  # bucket -> (buffer, work)

    def arm(self, group, backwards: int, hold: frozenset[int] = frozenset()) -> None:
        """Launch each bucket over the DP `group` from the backward pass, once each of its parameters has
        accumulated `backwards` gradients (this step's micro-batches); buckets holding a parameter index
        in `hold` wait for ``finish`` (their gradients change after the backward: a tied embedding's)."""
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, i))
                           for i, p in enumerate(self.params)]
        self._reset()
        for k, b in enumerate(self.buckets):
            if hold.intersection(b.params):
                self._left[k] = -1  # never reaches 0
        self._armed = (group, backwards)

    def _accumulated(self, i: int, _param) -> None:
        if self._armed is None:
            return
        group, backwards = self._armed
        self._count[i] += 1
        if self._count[i] == backwards:
            k = self.bucket_of[i]
            self._left[k] -= 1
            if self._left[k] == 0:
                self._launch(k, group)

    def _launch(self, k: int, group) -> None:
        b = self.buckets[k]
        flat = torch.zeros(b.numel, dtype=torch.float32, device=self.params[b.params[0]].device)
        for d, pieces in enumerate(b.ranges):
            for pc in pieces:
                g = self.params[pc.index].grad
                if g is not None:
                    flat[b.span(d, pc)].copy_(g[pc.start:pc.stop].reshape(-1))
        if self.scatter:  # the buffer is the gradient from now on: the optimizer reads its own chunk only
            for i in b.params:
                self.params[i].grad = None
        self._started[k] = (flat, comm.start_reduce(flat, group, self.scatter))

    def finish(self, group) -> list[torch.Tensor]:
        """Every bucket's buffer summed over the DP `group` (this rank's chunk only, when scattering), in
        bucket order: launching those not launched yet, then waiting on all."""
        t0 = time.perf_counter()
        self._armed = None
        self.early = len(self._started)
        for k in range(len(self.buckets)):
            if k not in self._started:
                self._launch(k, group)
        flats = []
        for k in range(len(self.buckets)):
            flat, work = self._started[k]
            comm.wait(work)
            flats.append(flat)
        self._reset()
        self.finish_s = time.perf_counter() - t0
        return flats

    def abandon(self) -> None:
        """Drop the reductions in flight and stop launching (a failed step; see the optimizer's ``abandon``)."""
        self._armed = None
        self._reset()

    def close(self) -> None:
        """Remove the hooks (the plan is replaced)."""
        for h in self._hooks:
            h.remove()
        self._hooks, self._armed = [], None
