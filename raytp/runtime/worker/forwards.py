"""What a worker computes besides training steps: the logits of a batch (the validation loss is
raytp.train.step.eval_loss). With pipeline stages the forwards run through every stage
(raytp.train.stage_runner.pipeline_forward).
"""
from __future__ import annotations

import torch

from raytp.parallel import comm
from raytp.train.hyper import compute_precision
from raytp.train.stage_runner import pipeline_forward


@torch.no_grad()
def logits(model, idx: torch.Tensor, device: torch.device, groups, pipeline, hyper, vocab_size: int
           ) -> torch.Tensor | None:
    """Full-vocabulary logits (B, T, V) of a batch, gathered over TP (every TP rank must be called; with
    pipeline stages every rank of the replica, and those of the last stage answer, the others None)."""
    model.eval()
    idx = idx.to(device)
    if pipeline is not None:
        outs = pipeline_forward(model, [(idx, None)], groups, pipeline.stage, pipeline.sp, hyper)
        local = outs[0].float() if outs else None
    else:
        with compute_precision(hyper, device):
            local = model(idx).float()  # (B, T, V_pad/tp)
    model.train()
    if local is None:
        return None
    return comm.gather_last(local, groups.tp)[..., :vocab_size].cpu()
