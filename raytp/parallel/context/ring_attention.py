"""Ring attention over a CP group: causal attention of a sequence cut over ranks (raytp.parallel.context).

Each CP rank holds its two chunks of every sequence's queries, keys and values.
The keys and values (and, for packed documents, their document ids) go round the
group: at step ``s`` rank ``i`` holds those of rank ``i - s``, sends them on to
rank ``i + 1`` while it computes with them, and merges the block's result into
its running output by the online softmax (each row's log-sum-exp). A block is
computed chunk pair by chunk pair, and only where the causal order lets a query
see a key: a later chunk's keys are skipped whole, an earlier chunk's are seen
whole, a chunk's own under the causal triangle; document ids, where given, mask
within (a token sees only keys of its own document).

The backward pass goes round again with the keys and values and the gradients
accumulated for them; after the last step those gradients travel one more hop
and arrive at the rank that holds them. Sums run in float32 (the softmax's
statistics, the output and every gradient), whatever the inputs' dtype.

Query heads may be a multiple of the key/value heads (grouped-query attention):
keys and values travel unexpanded.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from raytp.parallel.context import attention_blocks as blocks
from raytp.parallel.context.sequence import chunks

NEG_INF = float("-inf")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, docs: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Causal attention of this CP rank's queries `q` (B, H, T_local, d) over the whole sequence's keys and values,
    of which this rank holds `k`, `v` (B, H_kv, T_local, d): its two chunks (raytp.parallel.context.shard).
    `group`: the CP process group (None: the world); `docs`: (B, T_local) document ids of its tokens, or None."""
    return _Ring.apply(q, k, v, docs, group)


def _rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _peer(group, rank: int) -> int:
    """The global rank of `group`'s rank `rank`."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _exchange(group, send: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
    """Start sending `send` to the next rank of the ring and receiving as much from the previous one:
    (requests to wait on, the buffers being filled)."""
    me, size = _rank_and_size(group)
    send = [t.contiguous() for t in send]
    recv = [torch.empty_like(t) for t in send]
    ops = [dist.P2POp(dist.isend, t, _peer(group, (me + 1) % size), group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, _peer(group, (me - 1) % size), group) for t in recv]
    return dist.batch_isend_irecv(ops), recv


def _pairs(cp: int, me: int, src: int) -> list[tuple[int, int, bool]]:
    """(query half, key half, causal) of every chunk pair in which rank `me`'s queries see rank `src`'s keys."""
    out = []
    for qi, cq in enumerate(chunks(cp, me)):
        for kj, ck in enumerate(chunks(cp, src)):
            if ck <= cq:
                out.append((qi, kj, ck == cq))
    return out


def _mask(dq: torch.Tensor | None, dk: torch.Tensor | None) -> torch.Tensor | None:
    """Which keys of a chunk pair each query sees by its document: (B, 1, c, c) bool; None without documents
    (the causal triangle of a chunk's own block is the block kernel's)."""
    return None if dq is None else (dq[:, :, None] == dk[:, None, :])[:, None]


def _expand(t: torch.Tensor, group_size: int) -> torch.Tensor:
    return t if group_size == 1 else t.repeat_interleave(group_size, dim=1)


def _half(t: torch.Tensor | None, i: int, c: int, dim: int = 2) -> torch.Tensor | None:
    return None if t is None else t.narrow(dim, i * c, c)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, docs, group):
        me, cp = _rank_and_size(group)
        B, H, T, d = q.shape
        c, g, scale = T // 2, H // k.shape[1], 1.0 / math.sqrt(d)
        qf = q.float()
        out = torch.zeros(B, H, T, d, dtype=torch.float32, device=q.device)
        lse = torch.full((B, H, T), NEG_INF, dtype=torch.float32, device=q.device)
        held = [k, v] + ([docs] if docs is not None else [])
        for step in range(cp):
            pending = _exchange(group, held) if step < cp - 1 else None
            src = (me - step) % cp
            kk, vv = _expand(held[0], g).float(), _expand(held[1], g).float()
            dk_ids = held[2] if docs is not None else None
            for qi, kj, causal in _pairs(cp, me, src):
                mask = _mask(_half(docs, qi, c, 1), _half(dk_ids, kj, c, 1))
                o, blk = blocks.forward(_half(qf, qi, c), _half(kk, kj, c), _half(vv, kj, c), causal, mask, scale)
                rows = slice(qi * c, (qi + 1) * c)
                new = torch.logaddexp(lse[:, :, rows], blk)
                keep = torch.where(new.isinf(), 0.0, torch.exp(lse[:, :, rows] - new))
                add = torch.where(new.isinf(), 0.0, torch.exp(blk - new))
                out[:, :, rows] = out[:, :, rows] * keep[..., None] + o * add[..., None]
                lse[:, :, rows] = new
            if pending is not None:
                for r in pending[0]:
                    r.wait()
                held = pending[1]
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.group = group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, docs = ctx.saved_tensors
        group = ctx.group
        me, cp = _rank_and_size(group)
        B, H, T, d = q.shape
        Hkv = k.shape[1]
        c, g, scale = T // 2, H // Hkv, 1.0 / math.sqrt(d)
        qf, do = q.float(), grad.float()
        delta = (do * out).sum(-1)  # (B, H, T): each row's sum of dO x O
        dq = torch.zeros_like(qf)
        held = [k, v] + ([docs] if docs is not None else [])
        dk = torch.zeros(B, Hkv, T, d, dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        for step in range(cp):
            src = (me - step) % cp
            kk, vv = _expand(held[0], g).float(), _expand(held[1], g).float()
            dk_ids = held[2] if docs is not None else None
            dke, dve = torch.zeros(B, H, T, d, device=q.device), torch.zeros(B, H, T, d, device=q.device)
            for qi, kj, causal in _pairs(cp, me, src):
                mask = _mask(_half(docs, qi, c, 1), _half(dk_ids, kj, c, 1))
                dqs, dks, dvs = blocks.backward(_half(do, qi, c), _half(qf, qi, c), _half(kk, kj, c), _half(vv, kj, c),
                                                _half(out, qi, c), _half(lse, qi, c), _half(delta, qi, c), causal,
                                                mask, scale)
                dq[:, :, qi * c:(qi + 1) * c] += dqs
                dke[:, :, kj * c:(kj + 1) * c] += dks
                dve[:, :, kj * c:(kj + 1) * c] += dvs
            dk += dke.view(B, Hkv, g, T, d).sum(2)
            dv += dve.view(B, Hkv, g, T, d).sum(2)
            if cp == 1:
                break
            # pass the keys, values and their gradients on; after the last step the gradients alone go one more
            # hop, home to the rank that holds those keys and values
            send = held + [dk, dv] if step < cp - 1 else [dk, dv]
            reqs, got = _exchange(group, send)
            for r in reqs:
                r.wait()
            if step < cp - 1:
                held, (dk, dv) = got[:-2], got[-2:]
            else:
                dk, dv = got
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
