"""Schedules: how one rank's micro-batches of a step go through forward and backward.

A schedule is ``schedule(model, micro_batches, groups, step, h) -> local loss``:
it leaves the micro-batches' gradients accumulated in the parameters' ``.grad``
(scaled so that they sum to the gradient of the mean loss) and returns this
rank's mean loss over them; raytp.train.step.finish_step does the rest (sync,
clip, update). ``accumulate`` is the schedule of a model held whole by its TP
group: each micro-batch forward then backward, in order. A pipeline schedule
(stages on other ranks) is another function of the same signature.
"""
from __future__ import annotations

import torch

from raytp.models.base import set_dropout_key
from raytp.parallel.groups import ProcessGroups
from raytp.seeds import derive_seed
from raytp.train import token_loss
from raytp.train.hyper import Hyper, compute_precision


def accumulate(model: torch.nn.Module, micro_batches, groups: ProcessGroups, step: int, h: Hyper) -> torch.Tensor:
    """Gradient accumulation: forward and backward of each micro-batch [(x, y), ...] in turn. Dropout masks
    are keyed by (seed, step, global micro-batch index), so they are the same at any layout. Micro-batches of
    packed documents weigh by their trained tokens (raytp.train.token_loss)."""
    n = len(micro_batches)
    loss_sum = torch.zeros((), device=next(model.parameters()).device)
    for i, mb in enumerate(micro_batches):
        set_dropout_key(model, derive_seed(h.seed, step, groups.dp_rank * n + i))
        with compute_precision(h, mb[0].device):
            loss = token_loss.forward(model, mb)
        token_loss.scaled(loss, mb, n).backward()
        loss_sum += loss.detach()
    return token_loss.rank_loss(loss_sum, micro_batches[0], n)
