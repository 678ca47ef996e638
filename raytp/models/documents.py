"""Documents packed in one sequence: the one representation raytp carries them in, and what is made of it.

A packed batch carries, beside its tokens (B, T), each position's document id (B, T), an integer equal
along a document and different from its neighbours' (a document is one contiguous run of a row). Nothing
else travels: a pipeline stage, a TP rank, an activation-checkpointed block, (later) a context-parallel
rank each build from the ids what they need, here:

- ``positions``: each token's position within its document (rope and learned positions restart there);
- ``attention_mask``: which keys each query sees, its own document's earlier positions, (B, 1, T, T) bool,
  built inside attention's forward from the ids, never carried between layers or stages;
- ``from_eod``: the ids of ``data.document_mask``'s documents, each ended by (and including) an
  end-of-document token.

Pure functions of tensors, no state: the same ids give the same positions and mask on every rank.
"""
from __future__ import annotations

import torch

from raytp.parallel.context import sequence as context


def from_eod(idx: torch.Tensor, eod: int) -> torch.Tensor:
    """Document ids (B, T) of token ids whose documents each end at (and include) an `eod` token."""
    ends = idx == eod
    return torch.cumsum(ends, dim=1) - ends.long()


def starts(ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: where a document starts (a row's first position, and where the id changes)."""
    first = torch.ones_like(ids[:, :1], dtype=torch.bool)
    return torch.cat([first, ids[:, 1:] != ids[:, :-1]], dim=1)


def positions(ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: each token's position within its document (0 at its first token)."""
    T = ids.shape[1]
    at = torch.arange(T, device=ids.device).expand_as(ids)
    first = torch.where(starts(ids), at, torch.zeros_like(at))
    return at - torch.cummax(first, dim=1).values


def attention_mask(ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: query i sees key j when j <= i and both are of one document."""
    T = ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    return ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


def trained_tokens(targets: torch.Tensor) -> torch.Tensor:
    """How many targets are trained on (the ignored ones are negative): a 0-d int64."""
    return (targets >= 0).sum()


def context_share(x: torch.Tensor, y: torch.Tensor, documents: torch.Tensor | None, cp: int, rank: int,
                  eod: int | None = None) -> tuple:
    """CP rank `rank`'s part of a batch (raytp.parallel.context): (x, y, document ids or None, None, positions),
    each (B, T / cp), a micro-batch's order (raytp.train.token_loss.parts). The ids are the batch's, or those
    `eod` tokens end (data.document_mask), and the positions restart at each document; both are worked out on
    the whole sequence before it is cut (a document may start on another rank)."""
    if documents is None and eod is not None:
        documents = from_eod(x, eod)
    pos = torch.arange(x.shape[1], device=x.device).expand_as(x) if documents is None else positions(documents)
    cut = [None if t is None else context.shard(t, cp, rank, dim=1) for t in (x, y, documents)]
    return cut[0], cut[1], cut[2], None, context.shard(pos, cp, rank, dim=1)
