"""Collectives as autograd functions (Megatron-LM's mappings).

Each function is a forward/backward pair over one process group, passed in as
an argument and kept on ``ctx``; a one-rank group (or None) returns its input
untouched. Names follow Megatron (Shoeybi et al. 2019, section 3):

- ``copy_to_tp``     Megatron's *f*: forward identity, backward all-reduce.
- ``reduce_from_tp`` Megatron's *g*: forward all-reduce, backward identity.
- ``gather_last`` / ``scatter_last``: all-gather / split along the last dim.
- ``gather_seq`` / ``reduce_scatter_seq``: sequence parallelism's pair
  (Korthikanti et al. 2022, section 4.2.2) along the sequence dim (dim 1 of
  (B, T, C)): all-gather forward / reduce-scatter backward, and the reverse.

Collectives are called as ``dist.<name>`` at call time, so a test can count
every collective the model issues by wrapping ``torch.distributed``.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

SEQ_DIM = 1  # activations are (B, T, C)


class CommStats:
    """Wall time spent inside collectives by this process (the workers report it per step): exposed, the
    step waiting on them; ``hidden``, the time a collective started asynchronously ran while the step
    computed (raytp.parallel.overlap: from its start to its end or to the wait, whichever came first).

    On CUDA, NCCL calls return once queued, so this counts launch time, not transfer time.
    """

    def __init__(self):
        self.seconds, self.calls, self.hidden = 0.0, 0, 0.0

    def timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def take(self) -> tuple[float, int]:
        """(seconds, calls) since the last take (``hidden`` is taken with ``take_hidden``)."""
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out

    def take_hidden(self) -> float:
        out, self.hidden = self.hidden, 0.0
        return out


STATS = CommStats()


def all_reduce(x: torch.Tensor, group, op=None) -> None:
    """In-place all-reduce (sum unless `op`), timed."""
    STATS.timed(dist.all_reduce, x, op=dist.ReduceOp.SUM if op is None else op, group=group)


def backend(group) -> str:
    """The backend of `group` ("gloo", "nccl")."""
    return str(dist.get_backend(group))


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# torch >= 2.13 names the single-tensor collectives *_single; older releases
# only have the *_tensor spelling. Looked up at call time (see module doc).
def _gather_into(out, x, group):
    STATS.timed(getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor, out, x, group=group)


def _reduce_scatter_into(out, x, group):
    STATS.timed(getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor, out, x, group=group)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """`out` = this rank's 1/n of `x` summed over `group` (gloo: an all-reduce and a slice), timed."""
    _reduce_scatter_into(out, x, group)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """`out` = every rank's `x` of `group`, rank after rank, timed."""
    _gather_into(out, x, group)


def start_reduce(flat: torch.Tensor, group, scatter: bool = False):
    """Start summing `flat` over `group` in place, asynchronously; the work to ``wait`` on. `scatter`: only
    rank r's 1/n chunk need come out summed (NCCL reduce-scatters in place; gloo's reduce-scatter is an
    all-reduce plus copies, so there `flat` is all-reduced in place: the same bits)."""
    if scatter and backend(group) != "gloo":
        chunk = flat.numel() // group_size(group)
        r = group_rank(group)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return STATS.timed(fn, flat[r * chunk:(r + 1) * chunk], flat, group=group, async_op=True)
    return STATS.timed(dist.all_reduce, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def wait(work) -> None:
    """Wait for a collective started asynchronously (the time spent waiting counts as collective time)."""
    STATS.timed(work.wait)


def all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `x` of `group` joined along T (not an autograd function: raytp.parallel.overlap's)."""
    return _all_gather(x, SEQ_DIM, group)


def reduce_scatter_in_place(flat: torch.Tensor, group) -> torch.Tensor:
    """Rank r's 1/n chunk of `flat` becomes that chunk summed over `group`, in place; returns the chunk (the
    rest of `flat` is left undefined; see start_reduce)."""
    chunk = flat.numel() // group_size(group)
    wait(start_reduce(flat, group, scatter=True))
    return flat[group_rank(group) * chunk:(group_rank(group) + 1) * chunk]


def start_all_gather_in_place(flat: torch.Tensor, group) -> list:
    """Start giving every rank each rank's 1/n chunk of `flat` (each set by its rank), in place, asynchronously;
    the works to ``wait`` on. NCCL all-gathers in place; gloo's all-gather allocates a copy of the whole output
    (measured), so there each chunk is broadcast from its rank instead."""
    n = group_size(group)
    chunk = flat.numel() // n
    if backend(group) == "gloo":
        return [STATS.timed(dist.broadcast, flat[d * chunk:(d + 1) * chunk],
                            src=d if group is None else dist.get_global_rank(group, d), group=group, async_op=True)
                for d in range(n)]
    r = group_rank(group)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return [STATS.timed(fn, flat, flat[r * chunk:(r + 1) * chunk], group=group, async_op=True)]


def all_gather_in_place(flat: torch.Tensor, group) -> None:
    """start_all_gather_in_place, waited for."""
    for work in start_all_gather_in_place(flat, group):
        wait(work)


def all_gather_float(x: float, device: torch.device, group=None) -> list[float]:
    """Every rank's `x` over `group` (the whole world if None), in rank order; not timed (a report, not the
    step's communication)."""
    n = dist.get_world_size(group)
    if n == 1:
        return [x]
    out = torch.empty(n, dtype=torch.float64, device=device)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, torch.tensor([x], dtype=torch.float64, device=device), group=group)
    return out.tolist()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    all_reduce(x, group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    x = x.contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_into(out, x, group)  # rank r's part at rows r*B..
    return out if dim == 0 else torch.cat(out.chunk(n, dim=0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {n} ranks")
    stacked = torch.cat(x.chunk(n, dim=dim), dim=0).contiguous()  # rank r's part at rows r*B..
    out = torch.empty((x.shape[0],) + stacked.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_into(out, stacked, group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {n} ranks")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    """f: forward identity, backward all-reduce (input of a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce, backward identity (output of a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLast(torch.autograd.Function):
    """Forward all-gather along the last dim, backward split."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, grad.dim() - 1, ctx.group), None


class _ScatterLast(torch.autograd.Function):
    """Forward split along the last dim (keep this rank's part), backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, grad.dim() - 1, ctx.group), None


class _GatherSeq(torch.autograd.Function):
    """SP entry to a TP region: forward all-gather along T, backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    """SP exit of a TP region: forward reduce-scatter along T, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


def _one_rank_identity(fn):
    def apply(x: torch.Tensor, group) -> torch.Tensor:
        if group_size(group) == 1:
            return x
        return fn.apply(x, group)

    apply.__doc__ = fn.__doc__
    apply.__name__ = fn.__name__.lstrip("_").lower()
    return apply


copy_to_tp = _one_rank_identity(_CopyToTP)
reduce_from_tp = _one_rank_identity(_ReduceFromTP)
gather_last = _one_rank_identity(_GatherLast)
scatter_last = _one_rank_identity(_ScatterLast)
gather_seq = _one_rank_identity(_GatherSeq)
reduce_scatter_seq = _one_rank_identity(_ReduceScatterSeq)
