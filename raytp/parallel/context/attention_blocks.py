"""One block of attention, queries of one chunk against keys of another, with the block's log-sum-exp: what ring
attention (raytp.parallel.context.ring_attention) merges and differentiates block by block.

On CPU the blocks run torch's fused flash-attention kernels (``_scaled_dot_product_flash_attention_for_cpu``
and its backward: they return the log-sum-exp and never hold a block's scores whole); elsewhere a plain
softmax over the block's scores (the same numbers, more memory). `mask`: which keys each query sees, (c, c) or
(B, 1, c, c) bool, or None for all; a row that sees none gets a zero output and a log-sum-exp of -inf.
The backward takes the *final* output and log-sum-exp of the rows (not the block's): P = exp(S - lse) is then
each block's share of the whole softmax, as in flash attention's backward.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def _additive(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(~mask, NEG_INF)


def forward(q, k, v, causal: bool, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of q (B, H, c, d) against k, v (B, H, c, d); `causal`: the block is its own chunk's
    (the causal triangle); `mask`: documents' (or None)."""
    if _fused(q):
        if mask is not None:  # the causal triangle folded into the documents' mask
            mask, causal = _seen(causal, mask, q.shape[-2], q.device), False
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_additive(mask, q), scale=scale)
        if mask is not None:  # the kernel gives a row that sees no key an lse of 0
            lse = lse.masked_fill(~mask.any(-1).expand_as(lse), NEG_INF)
        return o, lse
    s = q @ k.transpose(-1, -2) * scale
    seen = _seen(causal, mask, s.shape[-1], s.device)
    if seen is not None:
        s = s.masked_fill(~seen, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse)[..., None])
    return p @ v, lse


def backward(do, q, k, v, out, lse, delta, causal: bool, mask, scale: float) -> tuple:
    """(dq, dk, dv) of one block, given the rows' final output `out`, log-sum-exp `lse` and ``delta`` (each row's
    sum of dO x O)."""
    if _fused(q):
        if mask is not None:
            mask, causal = _seen(causal, mask, q.shape[-2], q.device), False
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q), scale=scale)
    s = q @ k.transpose(-1, -2) * scale
    p = torch.exp(s - lse[..., None])
    seen = _seen(causal, mask, s.shape[-1], s.device)
    if seen is not None:
        p = p.masked_fill(~seen, 0.0)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.transpose(-1, -2) - delta[..., None])
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv


def _seen(causal: bool, mask, c: int, device):
    """Which keys each of a block's c queries sees: the causal triangle and the documents' mask, or None."""
    tri = torch.ones(c, c, dtype=torch.bool, device=device).tril() if causal else None
    if mask is None:
        return tri
    return mask if tri is None else mask & tri
