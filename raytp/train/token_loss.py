"""The loss of a batch of packed documents: the sum over its trained tokens divided by their count over the
global batch (every micro-batch, pipeline stage and DP replica), so that no layout changes it.

A micro-batch is ``(x, y)`` (pretraining: every target counts, each micro-batch's mean loss weighs 1/n, as it
always has, to the bit) or ``(x, y, documents)``: packed documents' ids (raytp.models.documents), targets of
-1 not trained on (a conversation's prompts, padding). With documents the model returns the *sum* of its
trained tokens' losses; ``weighted`` counts them over the global batch (one all-reduce of one number over the
ranks that sum the gradients, DP x CP, the same on every stage and TP rank, which all hold the targets) and
gives each micro-batch the weight ``dp x cp / count``: the mean the step takes of the loss and the gradients
over those ranks then makes them sum / count. A CP rank's micro-batch also carries its tokens' positions in
the whole sequence (fifth: ``(x, y, documents or None, None, positions)``).
"""
from __future__ import annotations

import torch

from raytp.models.documents import trained_tokens
from raytp.parallel import comm


def parts(mb) -> tuple:
    """(x, y, documents or None, weight or None, positions or None) of a micro-batch as the schedules get it."""
    x, y, *rest = mb
    rest = rest + [None] * (3 - len(rest))
    return x, y, rest[0], rest[1], rest[2]


def weighted(micro_batches, groups) -> tuple[list, int | None]:
    """The micro-batches with their weights (x, y, documents, weight), and the trained tokens of the global
    batch; as they are, and None, when they carry no documents (pretraining)."""
    if not micro_batches or parts(micro_batches[0])[2] is None:
        return micro_batches, None
    counts = [trained_tokens(parts(mb)[1]) for mb in micro_batches]
    total = torch.stack(counts).sum().to(torch.float64).reshape(1)
    if groups.grad is not None:
        comm.all_reduce(total, groups.grad)
    tokens = int(total.item())
    scale = groups.layout.grad_degree / max(tokens, 1)
    return [(*parts(mb)[:3], scale, parts(mb)[4]) for mb in micro_batches], tokens


def forward(model, mb, **kw) -> torch.Tensor:
    """The model's output for one micro-batch (its loss when it ends the model and has targets: the mean, or
    with documents the sum over trained tokens). `kw`: a pipeline stage's hidden and layers."""
    x, y, documents, _, positions = parts(mb)
    if positions is not None:
        kw["positions"] = positions
    return model(x, y, **kw) if documents is None else model(x, y, documents=documents, **kw)


def scaled(loss: torch.Tensor, mb, n: int) -> torch.Tensor:
    """A micro-batch's loss (of n) as its backward starts from it: the mean's 1/n, or its weight."""
    weight = parts(mb)[3]
    return loss / n if weight is None else loss * weight


def rank_loss(loss_sum: torch.Tensor, mb, n: int) -> torch.Tensor:
    """This rank's part of the step's loss from the sum of its n micro-batches' losses (the step then takes
    the DP mean and the sum over stages)."""
    weight = parts(mb)[3]
    return loss_sum / n if weight is None else loss_sum * weight
