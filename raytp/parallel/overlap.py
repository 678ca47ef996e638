"""The backward pass of a tensor-parallel entry with its collective hidden behind the weight-gradient GEMMs.

The entry of a column-parallel region (Megatron's *f*, or the sequence all-gather under sequence
parallelism) sums the input's gradient over TP in the backward pass (an all-reduce, or a reduce-scatter
along the sequence). Done as an autograd node of its own, that collective starts only after every
projection behind it has computed both of its gradients, and nothing runs while it does. Here (Megatron's
``async_grad_allreduce`` / ``gradient_accumulation_fusion`` order) each projection computes its input's
gradient only and leaves the GEMM of its weight's gradient to the entry; the entry starts the collective
asynchronously, computes the weights' gradients while it runs, and then waits for it.

- ``column_parallel``: one projection with its own entry (GPT-2's c_attn and c_fc, a vocabulary-parallel
  head): one autograd function for both.
- ``Entry`` + ``deferred_linear``: one entry feeding several projections (Llama's q, k, v; gate, up). The
  weights are inputs of the entry's function, which returns their gradients, so autograd accumulates them
  as it would (the gradient buckets' hooks fire as always); the projections return none for them.

The GEMMs are those of torch's own linear backward, in the same order (the input's gradient ``g @ W``,
the weight's ``g^T x``, the bias's ``sum_rows g``), in the compute dtype (bf16 under autocast, then
cast to the parameter's), so the gradients are the same bits as without overlap (tests/test_tp_overlap.py).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytp.parallel import comm


class Pending:
    """An entry gradient's collective in flight (``start_entry_grad``): its output, its work, the input it
    reads, when it started, and when it ended (set by the work's future, where the backend has one)."""

    def __init__(self, out, work, reads):
        self.out, self.work, self.reads, self.started, self.ended = out, work, reads, time.perf_counter(), None
        try:
            work.get_future().add_done_callback(self._ended)
        except (AttributeError, RuntimeError):  # a backend without futures: counted up to the wait
            pass

    def _ended(self, _future) -> None:
        self.ended = time.perf_counter()


def start_entry_grad(g: torch.Tensor, group, sequence_parallel: bool) -> Pending:
    """Start summing the gradient `g` of a TP entry's output over `group`, asynchronously: an all-reduce (f's
    backward), or under sequence parallelism a reduce-scatter along T (the all-gather's)."""
    if sequence_parallel:
        n = comm.group_size(group)
        stacked = torch.cat(g.chunk(n, dim=comm.SEQ_DIM), dim=0).contiguous()  # rank r's part at rows r*B..
        out = torch.empty((g.shape[0],) + stacked.shape[1:], dtype=g.dtype, device=g.device)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return Pending(out, comm.STATS.timed(fn, out, stacked, group=group, async_op=True), stacked)
    out = g.contiguous()
    return Pending(out, comm.STATS.timed(dist.all_reduce, out, op=dist.ReduceOp.SUM, group=group, async_op=True), out)


def finish_entry_grad(p: Pending) -> torch.Tensor:
    """Wait for `p` (the wait counts as exposed collective time; what ran before it, as hidden)."""
    t = time.perf_counter()
    comm.wait(p.work)
    end = p.ended if p.ended is not None and p.ended < t else t
    comm.STATS.hidden += max(0.0, end - p.started)
    return p.out


def _cast(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.to(like.dtype)


def _linear(ctx, x: torch.Tensor, weight, bias) -> torch.Tensor:
    """x W^T + b in x's dtype (the compute dtype: autocast's cast done here, as autocast would), saving x and the
    cast weight for the backward pass."""
    w, b = _cast(weight, x), _cast(bias, x)
    ctx.save_for_backward(x, w)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x, w, b)


def _linear_grads(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple:
    """(the input's gradient, then a function of (the weight's gradient, the bias's)) of y = x W^T + b."""
    g2 = g.reshape(-1, g.shape[-1])
    gx = g2.mm(w).view(*g.shape[:-1], w.shape[1])

    def weight_grads():
        return g2.t().mm(x.reshape(-1, x.shape[-1])), g2.sum(0)
    return gx, weight_grads


class _ColumnParallel(torch.autograd.Function):
    """y = f(x) W^T + b (f: identity forward, or the sequence all-gather), its backward overlapped."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        whole = comm.all_gather_seq(x, group) if sequence_parallel else x
        ctx.group, ctx.sp, ctx.dtypes = group, sequence_parallel, (weight.dtype, None if bias is None else bias.dtype)
        return _linear(ctx, whole, weight, bias)

    @staticmethod
    def backward(ctx, g):
        whole, w = ctx.saved_tensors
        gx, weight_grads = _linear_grads(g, whole, w)
        pending = start_entry_grad(gx, ctx.group, ctx.sp)
        gw, gb = weight_grads()
        gx = finish_entry_grad(pending)
        wd, bd = ctx.dtypes
        return gx, gw.to(wd), None if bd is None else gb.to(bd), None, None


def column_parallel(x: torch.Tensor, weight, bias, group, sequence_parallel: bool) -> torch.Tensor:
    return _ColumnParallel.apply(x, weight, bias, group, sequence_parallel)


class Entry:
    """One forward pass of a shared entry: the weight-gradient GEMMs its projections leave to it (by the
    index of the parameter among the entry's, in its order)."""

    def __init__(self):
        self.pending: list[tuple[int, object]] = []


class _SharedEntry(torch.autograd.Function):
    """f (or the sequence all-gather) before several projections whose parameters it is given; its backward
    starts the input gradient's collective, then computes their gradients while it runs."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, entry, *params):
        ctx.group, ctx.sp, ctx.entry, ctx.dtypes = group, sequence_parallel, entry, [p.dtype for p in params]
        return comm.all_gather_seq(x, group) if sequence_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        pending = start_entry_grad(g, ctx.group, ctx.sp)
        grads = [None] * len(ctx.dtypes)
        for i, fn in sorted(ctx.entry.pending, key=lambda e: e[0]):
            grads[i] = fn()
        ctx.entry.pending.clear()
        gx = finish_entry_grad(pending)
        return (gx, None, None, None, *(None if t is None else t.to(d) for t, d in zip(grads, ctx.dtypes)))


def shared_entry(x: torch.Tensor, group, sequence_parallel: bool, entry: Entry, params) -> torch.Tensor:
    return _SharedEntry.apply(x, group, sequence_parallel, entry, *params)


class _Deferred(torch.autograd.Function):
    """y = x W^T + b behind a shared entry: its backward returns the input's gradient and leaves the weight's
    and the bias's to the entry (parameters `at` and `at + 1` of it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, entry, at):
        ctx.entry, ctx.at, ctx.has_bias = entry, at, bias is not None
        return _linear(ctx, x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx, weight_grads = _linear_grads(g, x, w)
        both = {}

        def part(k):
            def fn():
                if not both:
                    both.update(enumerate(weight_grads()))
                return both[k]
            return fn
        ctx.entry.pending.append((ctx.at, part(0)))
        if ctx.has_bias:
            ctx.entry.pending.append((ctx.at + 1, part(1)))
        return gx, None, None, None, None


def deferred_linear(x: torch.Tensor, weight, bias, entry: Entry, at: int) -> torch.Tensor:
    return _Deferred.apply(x, weight, bias, entry, at)
