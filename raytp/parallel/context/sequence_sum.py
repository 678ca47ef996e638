"""Sums over a whole sequence where context parallelism cuts it: a module a layer holds for statistics of each
sequence that need every token (an MoE router's per-sequence balance loss), bound to the CP group like every
parallel layer to its axis's group (``group_axis``).

Forward: this rank's sums over its tokens, all-reduced over the CP group, so every CP rank holds the sequence's.
Backward: the gradient all-reduced too. Every CP rank computes the same loss from the sums, so the gradient of
this rank's part is the sum of what each rank's copy of the loss gives it: cp times the one loss's. The step then
sums every rank's gradients over DP x CP and divides by that many (as it does the language-model loss's, whose
ranks each hold a part of it), which leaves the one loss's gradient once. At cp 1 (no group) it is the identity.
``earlier``: what the sequence's tokens before each of this rank's chunks counted (an expert's capacity is taken in
the order of the whole sequence).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from raytp.parallel import comm
from raytp.parallel.context.sequence import chunks


class _SumBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        comm.all_reduce(out, ctx.group)
        return out, None


class SequenceSum(nn.Module):
    group_axis = "cp"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self):
        super().__init__()
        self.group = None

    @property
    def degree(self) -> int:
        """How many ranks hold parts of each sequence (1 without a group)."""
        return comm.group_size(self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (any shape: this rank's sums over its tokens) summed over the sequence's CP ranks."""
        return x if self.group is None else _SumBoth.apply(x, self.group)

    def counts(self, x: torch.Tensor) -> torch.Tensor:
        """The same sum for a tensor no gradient flows through (counts of choices), in place."""
        if self.group is not None:
            comm.all_reduce(x, self.group)
        return x

    def earlier(self, hits: torch.Tensor) -> torch.Tensor:
        """For counts along this rank's tokens in its order, `hits` (B, L, E) (L: its tokens, or their choices in
        order, its two chunks one after the other: raytp.parallel.context.sequence), the counts of the whole
        sequence's tokens before each of its chunks (B, L, E): each chunk's sums gathered from every rank, summed
        over the chunks before it in the sequence's order."""
        B, L, E = hits.shape
        mine = hits.reshape(B, 2, L // 2, E).sum(dim=2)  # (B, 2, E): each of its chunks' counts
        parts = [torch.empty_like(mine) for _ in range(self.degree)]
        torch.distributed.all_gather(parts, mine.contiguous(), group=self.group)
        cp = self.degree
        by_chunk = torch.empty(B, 2 * cp, E, dtype=mine.dtype, device=mine.device)
        for rank, part in enumerate(parts):
            by_chunk[:, list(chunks(cp, rank))] = part
        before = torch.cumsum(by_chunk, dim=1) - by_chunk  # (B, 2 cp, E): the chunks before each
        first, second = chunks(cp, comm.group_rank(self.group))
        return before[:, [first, second]].repeat_interleave(L // 2, dim=1)
