"""Ulysses attention over a CP group (DeepSpeed Ulysses): all-to-all from a part of the sequence to a part of the heads.

Each CP rank holds every head of its tokens (its two chunks, raytp.parallel.context).
One all-to-all gives each rank a ``1/cp`` share of the heads over the whole
sequence, put back in the sequence's order; attention runs there as on one
device (causal, within each document where document ids are given: those are
gathered whole, being small); a second all-to-all returns every head of the
rank's own tokens. The backward pass runs the two exchanges the other way.
Query and key/value heads must both divide by cp (``refusal``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytp.parallel.context import sequence as context


def refusal(heads: int, kv_heads: int, cp: int) -> str | None:
    """Why Ulysses cannot split these heads (per TP rank) over `cp` ranks; None if it can."""
    if heads % cp or kv_heads % cp:
        return (f"parallel.cp_attention: ulysses splits the heads over cp: the query heads ({heads}) and the KV heads "
                f"({kv_heads}) of each TP rank must divide by cp ({cp}); use ring")
    return None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, docs: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Causal attention of this CP rank's tokens, `q` (B, H, T_local, d), `k`, `v` (B, H_kv, T_local, d), over the
    whole sequence held by `group` (None: the world); `docs`: (B, T_local) document ids or None."""
    cp = dist.get_world_size(group)
    why = refusal(q.shape[1], k.shape[1], cp)
    if why is not None:
        raise ValueError(why)
    q, k, v = (_Exchange.apply(t, group, True) for t in (q, k, v))
    group_size = q.shape[1] // k.shape[1]
    if group_size > 1:
        k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
    if docs is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        parts = [torch.empty_like(docs) for _ in range(cp)]
        dist.all_gather(parts, docs.contiguous(), group=group)
        ids = context.unshard(parts, dim=1)
        T = ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal & (ids[:, :, None] == ids[:, None, :])[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return _Exchange.apply(y, group, False)


def _to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, T_local, d) of this rank's tokens -> (B, H / cp, T, d) of its share of the heads, in sequence order."""
    cp = dist.get_world_size(group)
    send = [c.contiguous() for c in x.chunk(cp, dim=1)]
    got = [torch.empty_like(send[0]) for _ in range(cp)]
    dist.all_to_all(got, send, group=group)
    return context.unshard(got, dim=2)


def _to_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H / cp, T, d) of a share of the heads -> (B, H, T_local, d) of every head of this rank's tokens."""
    cp = dist.get_world_size(group)
    send = [context.shard(x, cp, r, dim=2).contiguous() for r in range(cp)]
    got = [torch.empty_like(send[0]) for _ in range(cp)]
    dist.all_to_all(got, send, group=group)
    return torch.cat(got, dim=1)


class _Exchange(torch.autograd.Function):
    """One of the two all-to-alls (`to_heads`: tokens -> heads, else back); its backward is the other one."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_to_heads if to_heads else _to_tokens)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_to_tokens if ctx.to_heads else _to_heads)(grad.contiguous(), ctx.group), None, None
