"""Tokens to their experts and back over the expert-parallel group: all-to-all, as autograd functions.

With expert parallelism (ep > 1) each rank of an EP group holds ``n_experts / ep`` consecutive experts
(rank r: experts r * E/ep ..), and each rank routes its own tokens. ``ExpertDispatch`` sends every
(token, chosen expert) pair to the rank holding that expert, runs its local experts on what it received,
and sends the outputs back (Megatron's AlltoAll token dispatcher, torchtitan's ``TokenDispatcher``):

1. the choices sorted by expert (stable: tokens in order), so the rows for each rank are contiguous;
2. how many rows each rank gets for each of its experts: one all-to-all of an (ep, E/ep) count table, so
   every receiver knows its split sizes before the rows move;
3. the rows (all-to-all, uneven splits), regrouped by local expert, each expert run on its rows (on no rows
   when none chose it, so every expert has a gradient every step), put back in arrival order;
4. the outputs back (the reverse all-to-all), weighted by the router at the token's own rank, summed per token.

Backward is the same exchange reversed (``_AllToAll``). With ep == 1 nothing is exchanged: the same
grouping runs on the local experts. The weighting happens where the router ran, so the router's gradient
never crosses ranks. Bytes each way per layer: tokens * k * n_embd * element size (every choice one row).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from raytp.parallel import comm


class _AllToAll(torch.autograd.Function):
    """Rows `x` split by `send` (rows to each rank, in rank order) exchanged for `recv` rows from each rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    comm.STATS.timed(dist.all_to_all_single, out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows (a one-rank group returns `x`)."""
    if comm.group_size(group) == 1:
        return x
    return _AllToAll.apply(x, send, recv, group)


def per_expert(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many of the choices in `experts` (any shape) went to each expert: (n_experts,) int64, on their device.
    A scatter-add, not ``torch.bincount``, which on a GPU reads the largest index back to the host (a sync in
    every MoE layer's forward)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts (ep, n): what this rank sends to each rank, per that rank's expert -> (ep, n): what each rank
    sends to this one."""
    if comm.group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    comm.STATS.timed(dist.all_to_all_single, out, counts.contiguous(), group=group)
    return out


class ExpertDispatch(nn.Module):
    """Runs the experts a layer's tokens chose, wherever they are held (see the module's text)."""
    group_axis = "ep"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self, n_experts: int, group=None, ep: int = 1, ep_rank: int = 0):
        super().__init__()
        if n_experts % ep:
            raise ValueError(f"ep={ep} does not divide n_experts={n_experts}")
        self.n_experts, self.group, self.ep = n_experts, group, ep
        self.local = n_experts // ep
        self.first = ep_rank * self.local  # the global index of this rank's first expert
        self.sent_rows = 0  # rows sent to other ranks in the last forward (for the all-to-all bytes)

    def forward(self, flat: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                compute) -> torch.Tensor:
        """flat (n, C) tokens; the choices as three (m,) lists in token order: which token, which expert,
        its weight -> (n, C): each token's weighted sum of its experts' outputs (zero for a token with no
        choice here). `compute(rows, sizes)`: this rank's experts, in order, on their rows (sizes[j] for local
        expert j: a list, or at ep == 1 a tensor on the rows' device; raytp.models.moe.grouped)."""
        order = experts.argsort(stable=True)  # the choices grouped by expert, tokens in order
        tokens, w = tokens[order], weights[order]
        counts = per_expert(experts, self.n_experts)
        if self.ep == 1:  # one rank: its rows, grouped by expert, are what its experts run (sizes on the device)
            back = compute(flat[tokens], counts)
            send = recv = [len(tokens)]
        else:  # the split sizes of an all-to-all are read on the host
            table = counts.view(self.ep, self.local)  # exchanged where it is, then read
            send_table, recv_table = table.cpu(), exchange_counts(table, self.group).cpu()
            send, recv = send_table.sum(1).tolist(), recv_table.sum(1).tolist()
            rows = all_to_all(flat[tokens], send, recv, self.group)  # by source rank, each by local expert
            # Regroup by local expert: source s's rows for expert j start at starts[s, j].
            starts = torch.cumsum(recv_table.reshape(-1), 0).view_as(recv_table) - recv_table
            by_expert = [torch.arange(int(starts[s, j]), int(starts[s, j] + recv_table[s, j]))
                         for j in range(self.local) for s in range(self.ep)]
            perm = torch.cat(by_expert).to(flat.device) if by_expert else torch.zeros(0, dtype=torch.long)
            done = compute(rows[perm], recv_table.sum(0).tolist())
            back = all_to_all(_unpermute(done, perm), recv, send, self.group)
        self.sent_rows = sum(send) - send[comm.group_rank(self.group)]
        out = torch.zeros_like(flat)
        out.index_add_(0, tokens, (back * w[:, None]).to(out.dtype))
        return out


def _unpermute(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """y with y[perm[i]] = x[i] (differentiable)."""
    return x[torch.argsort(perm)]
