"""The peer of bench/pipeline.py: the same pipeline stage trained by ``torch.distributed.pipelining``.

The stage module is raytp's own shard of the stage (``build_shard(cfg, SEED, tp_group, stage=stage)``:
the same layers, the same seeded numbers, at tp = 2 its TP layers and vocabulary-parallel loss), wrapped
so that torch's ``PipelineStage`` can run it: tokens (first stage) or the residual stream in, the
residual stream or the logits out; the loss is the shard's own criterion, called by ``Schedule1F1B`` on
the last stage. What differs from raytp's step is then only the pipeline: torch's schedule, its
point-to-point (the whole activation from every TP rank, batched send/receive pairs waited on in
turn) and its gradient scaling (1/m after the step, where raytp scales each loss). The rest of the step
is raytp's ``finish_step`` in both (the tied embedding's two copies summed, the global norm over TP x PP,
clipping, AdamW): torch.distributed.pipelining has no step of its own beyond the schedule.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from raytp.models.stage import Stage
from raytp.parallel.groups import ProcessGroups
from raytp.train.hyper import Hyper
from raytp.train.step import StepResult, finish_step

PEER = ("torch.distributed.pipelining (PipelineStage + Schedule1F1B, gloo) running raytp's stage shard, "
        "raytp's finish_step (tied-embedding sum, global-norm clip, AdamW) after it")


class StageModule(nn.Module):
    """raytp's stage shard as a module of one input: tokens (B, T) on the first stage, else the residual
    stream (B, T, C); out the residual stream, or the (vocabulary-sharded) logits on the last stage."""

    def __init__(self, shard: nn.Module, stage: Stage):
        super().__init__()
        self.shard, self.layers, self.first = shard, stage.chunk(stage.rank), stage.first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            return self.shard(x, layers=self.layers)
        length_only = torch.empty(x.shape[:2], dtype=torch.long)  # forward reads its sequence length only
        return self.shard(length_only, hidden=x, layers=self.layers)


class TorchPipeline:
    """One rank's stage under Schedule1F1B with m micro-batches, and its training step."""

    def __init__(self, shard: nn.Module, stage: Stage, groups: ProcessGroups, m: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        self.shard, self.stage, self.groups = shard, stage, groups
        self.pipe_stage = PipelineStage(StageModule(shard, stage), stage.rank, stage.pp, torch.device("cpu"),
                                        group=groups.pp)
        # every stage passes the loss (torch runs backward only when it is given); only the last calls it
        self.schedule = Schedule1F1B(self.pipe_stage, m, loss_fn=lambda logits, y: shard.criterion(logits, y))

    def step(self, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, step: int,
             h: Hyper) -> StepResult:
        """One optimizer step on the batch (x, y) (cut into m micro-batches along the batch, as raytp's)."""
        self.shard.train()
        optimizer.zero_grad(set_to_none=False)
        losses: list[torch.Tensor] = []
        if self.stage.first:
            self.schedule.step(x)
        elif self.stage.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        local = torch.stack(losses).detach().mean() if losses else torch.zeros(())
        return finish_step(self.shard, optimizer, self.groups, step, h, local)
