"""What a worker computes besides training steps: the validation loss and the logits of a batch.

A mixin of the Worker (raytp.runtime.worker.worker), reading its model, groups,
job and pipeline schedule; with pipeline stages both run the forwards only
through every stage (raytp.train.stage_runner.pipeline_forward).
"""
from __future__ import annotations

import torch

from raytp.parallel import comm
from raytp.runtime.errors import WorkerAborted
from raytp.train.hyper import compute_precision
from raytp.train.stage_runner import pipeline_forward
from raytp.train.step import eval_loss


class WorkerForwards:
    def evaluate(self, step: int) -> float:
        cfg = self.cfg
        batches = []
        for i in range(cfg.train.eval_steps):
            batches += self._micro_batches("val", step * cfg.train.eval_steps + i)
        try:
            return eval_loss(self.model, batches, self.groups, self.hyper, self.pipeline)
        except Exception as e:  # noqa: BLE001 - as in run_steps: leave, so that peers get out too
            failure = f"rank {self.rank} left evaluation: {type(e).__name__}: {e}"
        self.leave_groups()
        raise WorkerAborted(failure)

    @torch.no_grad()
    def logits(self, idx: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits (B, T, V) of a batch, gathered over TP (every TP rank must be called; with
        pipeline stages every rank of the replica, and those of the last stage answer, the others None)."""
        self.model.eval()
        idx = idx.to(self.device)
        if self.pipeline is not None:
            outs = pipeline_forward(self.model, [(idx, None)], self.groups, self.pipeline.stage,
                                    self.pipeline.sp, self.hyper)
            local = outs[0].float() if outs else None
        else:
            with compute_precision(self.hyper, self.device):
                local = self.model(idx).float()  # (B, T, V_pad/tp)
        self.model.train()
        if local is None:
            return None
        return comm.gather_last(local, self.groups.tp)[..., :self.cfg.model.vocab_size].cpu()
