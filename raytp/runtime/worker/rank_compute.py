"""What a rank computes: a training step, as the record the driver reads (its batch, the step, its times
and memory), and the logits of a batch (the validation loss is raytp.train.step.eval_loss).

The step's last collective (the record's gather of every rank's compute time) comes before its optimizer
update, so that a peer lost in it leaves every rank's state as it was.

The batch is a pure function of (seed, step, DP rank), so any rank of any
process computes the same micro-batches for the same place in the mesh. The
record's ``rank_compute_s`` holds every rank's compute time (the step less its
communication), gathered once per step: who holds back whom
(raytp.runtime.driver.watches). With pipeline stages the logits' forwards run through every stage
(raytp.train.stage_runner.pipeline_forward).
"""
from __future__ import annotations

import time

import torch

from raytp.data.corpus import batch, check_ids, epochs_read
from raytp.models.documents import context_share
from raytp.parallel import comm
from raytp.train.efficiency import peak_memory
from raytp.train.expert_load import expert_figures
from raytp.train.hyper import compute_precision
from raytp.train.stage_runner import pipeline_forward
from raytp.train.step import eval_loss, train_step


def micro_batches(cfg, corpus, groups, device: torch.device, split: str, step: int, eod: int | None = None) -> list:
    """This rank's micro-batches of `split` at `step`, on `device`, checked against the vocabulary; at cp > 1
    its part of each sequence (raytp.parallel.context), with its tokens' positions and document ids (those
    `eod` ends, data.document_mask's, found in the whole sequence first)."""
    parts = batch(corpus, split, cfg.train.seed, step, groups.dp_rank, groups.layout.dp, cfg.train.batch_size,
                  cfg.model.block_size)  # (x, y), or of conversations (x, y, documents)
    check_ids(parts[0], parts[1], cfg.model.vocab_size, split, step)
    if groups.layout.cp > 1:
        parts = context_share(parts[0], parts[1], parts[2] if len(parts) > 2 else None, groups.layout.cp,
                              groups.cp_rank, eod)
    n = cfg.micro_batch
    count = -(-parts[0].shape[0] // n)
    return list(zip(*([None] * count if t is None else t.to(device, non_blocking=True).split(n) for t in parts)))


def train_record(cfg, corpus, shard, groups, pipeline, device: torch.device, step: int, before_update=None,
                 batches_of=None) -> dict:
    """Run optimizer step `step` on `shard` (raytp.runtime.worker.held_shard.HeldShard) in `groups`; its
    record: loss, learning rate, gradient norm, times (whole, communication exposed and hidden behind compute,
    data), every rank's compute
    time, epochs read, peak memory, and what the expert layers did (raytp.train.expert_load).
    `batches_of(split, step)`: the micro-batches (default: micro_batches')."""
    comm.STATS.take(), comm.STATS.take_hidden()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    batches = (batches_of("train", step) if batches_of is not None
               else micro_batches(cfg, corpus, groups, device, "train", step))
    data_s = time.perf_counter() - t0
    gathered: dict = {}

    def gather_then_update() -> None:
        """The record's collectives, the step's last before its update (raytp.train.step.finish_step): a peer
        lost in them leaves this rank's state as it was, not updated by a step that then runs again."""
        gathered.update(expert_figures(shard.model, groups))  # {} without expert layers
        if device.type == "cuda":
            torch.cuda.synchronize()
        comm_s = comm.STATS.take()[0]
        gathered["comm_s"] = comm_s
        gathered["rank_compute_s"] = comm.all_gather_float(time.perf_counter() - t0 - comm_s, device)
        if before_update is not None:
            before_update()
    r = train_step(shard.model, shard.optimizer, batches, groups, step, shard.hyper, gather_then_update, pipeline)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    gathered["comm_s"] += comm.STATS.take()[0]  # zero 1's gather of the new weights
    tokens = r.loss_tokens if r.loss_tokens is not None else cfg.train.batch_size * cfg.model.block_size
    return {"step": step, "loss": r.loss, "loss_tokens": tokens, "lr": r.lr, "grad_norm": r.grad_norm,
            "step_time_s": elapsed,
            "comm_hidden_s": comm.STATS.take_hidden(), "data_s": data_s,
            "epoch": epochs_read(corpus, (step + 1) * cfg.train.batch_size, cfg.model.block_size),
            **peak_memory(device), **gathered}


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


def validation_loss(cfg, shard, groups, pipeline, step: int, batches_of) -> float:
    """The mean validation loss at `step` over cfg.train.eval_steps batches of this rank's (`batches_of(split,
    step)`), averaged over DP."""
    batches = []
    for i in range(cfg.train.eval_steps):
        batches += batches_of("val", step * cfg.train.eval_steps + i)
    return eval_loss(shard.model, batches, groups, shard.hyper, pipeline)
