"""One block of attention, queries of one chunk against keys of another, with the block's log-sum-exp: what ring
attention (raytp.parallel.context.ring_attention) merges and differentiates block by block.

On CPU the blocks run torch's fused flash-attention kernels (``_scaled_dot_product_flash_attention_for_cpu``
and its backward: they return the log-sum-exp and never hold a block's scores whole); elsewhere a plain
softmax over the block's scores, TILE query rows at a time (the same numbers; a tile's scores, TILE x c, are
all it holds at once, not the block's c x c: at 128k tokens over cp 8 a block's are 8k x 8k per head).
`mask`: which keys each query sees, (c, c) or
(B, 1, c, c) bool, or None for all; a row that sees none gets a zero output and a log-sum-exp of -inf.
The backward takes the *final* output and log-sum-exp of the rows (not the block's): P = exp(S - lse) is then
each block's share of the whole softmax, as in flash attention's backward.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")
TILE = 1024  # query rows of a plain block computed at once


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
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    for a in range(0, q.shape[-2], TILE):
        b = min(a + TILE, q.shape[-2])
        s = q[..., a:b, :] @ k.transpose(-1, -2) * scale
        seen = _seen(causal, mask, s.shape[-1], s.device, a, b)
        if seen is not None:
            s = s.masked_fill(~seen, NEG_INF)
        rows = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(rows.isinf(), 0.0, rows)[..., None])
        out[..., a:b, :], lse[..., a:b] = p @ v, rows
    return out, lse


def backward(do, q, k, v, out, lse, delta, causal: bool, mask, scale: float) -> tuple:
    """(dq, dk, dv) of one block, given the rows' final output `out`, log-sum-exp `lse` and ``delta`` (each row's
    sum of dO x O)."""
    if _fused(q):
        if mask is not None:
            mask, causal = _seen(causal, mask, q.shape[-2], q.device), False
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q), scale=scale)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, q.shape[-2], TILE):
        b = min(a + TILE, q.shape[-2])
        qa, da = q[..., a:b, :], do[..., a:b, :]
        s = qa @ k.transpose(-1, -2) * scale
        p = torch.exp(s - lse[..., a:b, None])
        seen = _seen(causal, mask, s.shape[-1], s.device, a, b)
        if seen is not None:
            p = p.masked_fill(~seen, 0.0)
        dv += p.transpose(-1, -2) @ da
        ds = p * (da @ v.transpose(-1, -2) - delta[..., a:b, None])
        dq[..., a:b, :] = ds @ k * scale
        dk += ds.transpose(-1, -2) @ qa * scale
    return dq, dk, dv


def _seen(causal: bool, mask, c: int, device, a: int = 0, b: int | None = None):
    """Which keys each of a block's queries a..b (all c without b) sees: the causal triangle and the documents'
    mask, or None."""
    b = c if b is None else b
    tri = torch.ones(b - a, c, dtype=torch.bool, device=device).tril(diagonal=a) if causal else None
    if mask is None:
        return tri
    mask = mask[..., a:b, :]
    return mask if tri is None else mask & tri
