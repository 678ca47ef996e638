"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019, section 3).

A Linear Y = X A + b splits two ways over p ranks:

- ``ColumnParallelLinear``: A = [A_1, ..., A_p] by output columns. Rank i
  computes Y_i = X A_i + b_i from the whole X (Megatron's f before it, or an
  all-gather along the sequence with sequence parallelism) and keeps its slice.
- ``RowParallelLinear``: A = [A_1; ...; A_p] by input rows. Rank i holds X_i
  (the output of a column-parallel layer) and computes the partial sum X_i A_i;
  Megatron's g (all-reduce) joins them, or a reduce-scatter along the sequence
  with sequence parallelism; the bias is added once, after.

An MLP (column, GELU, row) and attention (heads, output projection) therefore
need one all-reduce forward and one backward each.

The vocabulary is split too: ``VocabParallelEmbedding`` holds rows
[start, end) of the (padded) table; ``vocab_parallel_cross_entropy`` takes
each rank's logits slice and never forms the full (N, V) logits anywhere.
Every layer keeps its weight under the name nn.Linear/nn.Embedding use, so a
sharded model's state_dict has the one-device model's keys.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from raytp.parallel import comm, overlap


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's compute dtype when autocast is on (bf16: the TP collective that follows moves half
    the bytes; the matmul after it would cast x anyway, so the numbers are the same as one device's)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(dev))
    return x


def _mark_sequence_parallel(p: nn.Parameter | None) -> None:
    """Tag a replicated parameter whose gradient is partial under SP (summed over TP by the step)."""
    if p is not None:
        p.sequence_parallel = True


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i + b_i; input replicated (or sequence-sharded under SP), output sharded by columns."""
    group_axis = "tp"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, sequence_parallel: bool = False):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.overlap = True  # the backward's collective behind the weight-gradient GEMM (set_tp_overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = compute_dtype(x)
        if self.overlap:
            return overlap.column_parallel(x, self.weight, self.bias, self.group, self.sequence_parallel)
        x = comm.gather_seq(x, self.group) if self.sequence_parallel else comm.copy_to_tp(x, self.group)
        return F.linear(x, self.weight, self.bias)  # (B, T, out/p)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out_local={self.weight.shape[0]}, sp={self.sequence_parallel}"


class ParallelInput(nn.Module):
    """The entry collective that several column-parallel projections of one input share (Llama's q, k, v;
    gate, up): Megatron's f, or the sequence all-gather under SP. One per block, not one per projection."""
    group_axis = "tp"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.overlap = True  # (set_tp_overlap)
        self.consumers: list[ShardedLinear] = []  # the projections reading its output, when they are all of them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = compute_dtype(x)
        if self.overlap and self.consumers:  # their weight-gradient GEMMs run during its backward's collective
            entry, params = overlap.Entry(), []
            for c in self.consumers:
                c.entry = (entry, len(params))
                params += [c.weight] if c.bias is None else [c.weight, c.bias]
            return overlap.shared_entry(x, self.group, self.sequence_parallel, entry, params)
        return comm.gather_seq(x, self.group) if self.sequence_parallel else comm.copy_to_tp(x, self.group)


class ParallelOutput(nn.Module):
    """The exit collective of a block whose row-parallel part is not one Linear (an MoE layer's experts, each
    leaving a partial sum): Megatron's g, or the sequence reduce-scatter under SP."""
    group_axis = "tp"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return comm.reduce_scatter_seq(y, self.group) if self.sequence_parallel else comm.reduce_from_tp(y, self.group)


class ShardedLinear(nn.Module):
    """Y_i = X A_i: a column-parallel projection whose input a ParallelInput already made whole."""
    group_axis = "tp"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)  # its slice, split as the weight's rows
        self.entry = None  # (its ParallelInput's pass, its parameters' place there): set by that forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry is not None:
            (entry, at), self.entry = self.entry, None
            return overlap.deferred_linear(x, self.weight, self.bias, entry, at)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out_local={self.weight.shape[0]}"


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i A_i + b; input sharded by columns, output replicated (or sequence-sharded under SP)."""
    group_axis = "tp"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group, self.sequence_parallel = group, sequence_parallel
        if sequence_parallel:
            _mark_sequence_parallel(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # partial sum (B, T, out)
        y = comm.reduce_scatter_seq(y, self.group) if self.sequence_parallel else comm.reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_local={self.weight.shape[1]}, out={self.weight.shape[0]}, sp={self.sequence_parallel}"


def set_tp_overlap(model: nn.Module, on: bool) -> None:
    """Overlap each TP entry's backward collective with the weight-gradient GEMMs behind it
    (raytp.parallel.overlap; ``parallel.tp_overlap``), or not."""
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, ParallelInput)):
            m.overlap = on


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of a (padded) embedding table; other ranks' tokens look up zeros, g sums."""
    group_axis = "tp"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self, weight: torch.Tensor, start: int, group, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight)  # (V_pad/p, C)
        self.start, self.end = start, start + weight.shape[0]
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C) partial
        return comm.reduce_scatter_seq(out, self.group) if self.sequence_parallel else comm.reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return f"rows=[{self.start}, {self.end}), dim={self.weight.shape[1]}, sp={self.sequence_parallel}"


class SequenceShardedPositionEmbedding(nn.Embedding):
    """Under SP, returns only this rank's slice of the positions (the residual stream is sharded by T)."""
    group_axis = "tp"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self, weight: torch.Tensor, group):
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight.clone())
        self.group = group
        _mark_sequence_parallel(self.weight)

    def forward(self, T: int, positions: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """(T/p, C), or of `positions` (B, T) this rank's slice of them, (B, T/p, C)."""
        n, r = comm.group_size(self.group), comm.group_rank(self.group)
        if positions is not None:
            return F.embedding(positions[:, r * T // n:(r + 1) * T // n], self.weight)
        pos = torch.arange(r * T // n, (r + 1) * T // n, device=self.weight.device)
        return F.embedding(pos, self.weight)  # (T/p, C)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split by vocab (Megatron's cross_entropy.py).

    loss_n = log sum_v exp(z_nv - m_n) - (z_n,t_n - m_n), with m_n the global
    max; each rank contributes its slice's sum of exps and, where it owns the
    target, the target logit: one MAX and one SUM all-reduce in all.
    Columns at or past ``vocab_size`` are padding and get no probability.
    """

    @staticmethod
    def forward(ctx, logits, targets, start, vocab_size, group, summed=False):
        N, Vl = logits.shape
        logits = logits.float()
        if start + Vl > vocab_size:  # padded columns: never any mass
            logits = logits.clone()
            logits[:, max(vocab_size - start, 0):] = float("-inf")
        m = logits.max(dim=-1).values
        comm.all_reduce(m, group, op=dist.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(1)
        valid = targets >= 0
        mine = valid & (targets >= start) & (targets < start + Vl)
        local_t = (targets - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # (2, N): one all-reduce for both
        comm.all_reduce(sums, group)
        loss = (sums[0].log() - sums[1]).masked_fill(~valid, 0.0)
        count = torch.ones((), dtype=torch.long, device=loss.device) if summed else valid.sum().clamp(min=1)
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(1)), local_t, mine, valid, count)
        return loss.sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, mine, valid, count = ctx.saved_tensors
        g = softmax  # d loss_n / d z = softmax - onehot(target)
        g[torch.arange(g.shape[0], device=g.device)[mine], local_t[mine]] -= 1.0
        g *= (valid.unsqueeze(1).to(g.dtype) * grad / count)
        return g, None, None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for the model's LMLoss when the logits are split by vocab."""
    group_axis = "tp"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self, start: int, vocab_size: int, group):
        super().__init__()
        self.start, self.vocab_size, self.group = start, vocab_size, group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, summed: bool = False) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.start, self.vocab_size, self.group, summed)


def vocab_parallel_cross_entropy(logits, targets, start: int, vocab_size: int, group,
                                 summed: bool = False) -> torch.Tensor:
    """Mean cross entropy of (..., V/p) vocab-sharded logits against (...) targets; -1 is ignored (`summed`:
    the sum). In float32 whatever the logits' dtype (bf16 logits are upcast inside; never rounded to bf16)."""
    return _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), start, vocab_size, group, summed)
