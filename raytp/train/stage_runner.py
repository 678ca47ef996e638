"""The pipeline schedule: a stage's micro-batches through forward and backward, as a table says.

``PipelineSchedule`` has the signature of raytp.train.schedule's schedules, so
raytp.train.step.train_step runs it in place of the accumulation loop and
finishes the step the same way. It runs this stage's row of a table from
raytp.parallel.pipeline.pp_schedule (1F1B, or interleaved 1F1B over several model
chunks per stage), one action at a time: a forward receives the chunk's input
from the stage before (the first chunk embeds the tokens instead), runs the
chunk's layers (``model(idx, hidden=..., layers=...)``) and sends the result on,
or, on the last chunk, computes the loss; a backward receives the gradient of
its output (the last chunk starts from its loss), runs backward and sends the
gradient of its input back. The row says up front which messages the stage
receives, in which order (``expected_messages``), so raytp.parallel.pipeline.p2p can
post each receive before the stage needs it. Micro-batches keep their global
index for the dropout keys, so masks are those of one device, and every stage
accumulates its gradients in micro-batch order (the tables keep each chunk's
backwards in order), as the accumulation loop does.

``pipeline_forward`` is the forward-only pass (validation, sampling).
"""
from __future__ import annotations

import torch

from raytp.models.base import dropout_sites, set_dropout_key
from raytp.models.stage import Stage
from raytp.parallel import comm
from raytp.parallel.groups import ProcessGroups
from raytp.parallel.pipeline.p2p import Expected, StageLink, tag_of
from raytp.parallel.pipeline.pp_schedule import Action, schedule as schedule_table
from raytp.seeds import derive_seed
from raytp.train import token_loss
from raytp.train.hyper import Hyper, compute_precision


class PipelineSchedule:
    """Runs this rank's row of `name`'s table ("1f1b" or "interleaved") for `stage` (raytp.models.stage:
    every model chunk's layers, chunk c on stage c % pp)."""

    def __init__(self, name: str, stage: Stage, sequence_parallel: bool):
        self.name, self.stage, self.sp = name, stage, sequence_parallel
        # Autograd imports this (and sympy with it) at the first backward from a received gradient: 1-3 s, which
        # a fresh process (a replacement) would spend inside its first step's deadline. Paid here, as it is built.
        import torch.fx.experimental.symbolic_shapes  # noqa: F401
        self.chunks, self.virtual = stage.all_chunks, len(stage.split) // stage.pp
        self.sent_bytes = 0  # across nodes, in the last step (raytp.parallel.pipeline.p2p)

    def __call__(self, model: torch.nn.Module, micro_batches, groups: ProcessGroups, step: int,
                 h: Hyper) -> torch.Tensor:
        lay = groups.layout
        p, m, stage = lay.pp, len(micro_batches), groups.pp_rank
        n_chunks = len(self.chunks)
        row = schedule_table(self.name, p, m, self.virtual)[stage]
        shapes = [hidden_shape(model, mb[0], lay.tp, self.sp) for mb in micro_batches]
        device = next(model.parameters()).device
        link = StageLink(groups, self.sp, expected_messages(row, shapes, p, n_chunks), _dtype(model), device)
        held: dict[tuple[int, int], tuple] = {}  # (mb, chunk) -> (input, output) until its backward
        loss_sum = torch.zeros((), device=device)
        sites = dropout_sites(model)
        for a in row:
            mb = micro_batches[a.mb]
            set_dropout_key(model, derive_seed(h.seed, step, groups.dp_rank * m + a.mb), sites)  # F and B alike
            last = a.chunk == n_chunks - 1
            if a.kind == "F":
                hidden = None
                if a.chunk > 0:
                    hidden = link.recv(tag_of("F", a.mb, a.chunk - 1, n_chunks)).requires_grad_()
                with compute_precision(h, mb[0].device):
                    out = token_loss.forward(model, _targets(mb, last), hidden=hidden, layers=self.chunks[a.chunk])
                if last:
                    loss_sum += out.detach()
                    out = token_loss.scaled(out, mb, m)
                else:
                    link.send(out, (a.chunk + 1) % p, tag_of("F", a.mb, a.chunk, n_chunks))
                held[(a.mb, a.chunk)] = (hidden, out)
            else:
                hidden, out = held.pop((a.mb, a.chunk))
                if last:
                    out.backward()
                else:
                    out.backward(link.recv(tag_of("B", a.mb, a.chunk + 1, n_chunks)))
                if hidden is not None:
                    link.send(hidden.grad, (a.chunk - 1) % p, tag_of("B", a.mb, a.chunk, n_chunks))
        link.finish()
        self.sent_bytes = link.sent_bytes
        return token_loss.rank_loss(loss_sum, micro_batches[0], m)  # 0 off the last stage: summed over them


def _targets(mb, last: bool) -> tuple:
    """The micro-batch as a chunk runs it: its targets only on the last chunk (which computes the loss)."""
    return mb if last else (mb[0], None, *mb[2:])


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype  # the residual stream stays in the weights' precision


def expected_messages(row: list[Action], shapes: list[tuple[int, ...]], p: int, n_chunks: int) -> list[Expected]:
    """The messages a stage running `row` (its actions, in order) receives, in the order it takes them: a
    forward's input from the stage before (none for the first chunk), a backward's output gradient from the
    stage after (none for the last chunk); both of micro-batch mb's residual-stream shape, `shapes[mb]`."""
    out = []
    for a in row:
        if a.kind == "F" and a.chunk > 0:
            out.append(Expected((a.chunk - 1) % p, tag_of("F", a.mb, a.chunk - 1, n_chunks), shapes[a.mb]))
        elif a.kind == "B" and a.chunk < n_chunks - 1:
            out.append(Expected((a.chunk + 1) % p, tag_of("B", a.mb, a.chunk + 1, n_chunks), shapes[a.mb]))
    return out


def hidden_shape(model, x: torch.Tensor, tp: int, sequence_parallel: bool) -> tuple[int, ...]:
    """The residual stream's shape between stages for tokens `x` (B, T): (B, T, C), (B, T/tp, C) under SP."""
    B, T = x.shape
    return (B, T // tp if sequence_parallel and tp > 1 else T, model.cfg.n_embd)


@torch.no_grad()
def pipeline_forward(model: torch.nn.Module, micro_batches, groups: ProcessGroups, stage: Stage,
                     sequence_parallel: bool, h: Hyper | None = None) -> list:
    """The forwards only, each micro-batch [(x, y or None)] through this stage's chunks in order, receiving
    and sending as the training pass does: the last chunk's outputs (losses, or logits where y is None)
    on the last stage, [] elsewhere."""
    lay, chunks = groups.layout, stage.all_chunks
    p, here, n_chunks = lay.pp, groups.pp_rank, len(chunks)
    row = [Action("F", mb, c) for mb in range(len(micro_batches)) for c in range(here, n_chunks, p)]
    shapes = [hidden_shape(model, mb[0], lay.tp, sequence_parallel) for mb in micro_batches]
    link = StageLink(groups, sequence_parallel, expected_messages(row, shapes, p, n_chunks), _dtype(model),
                     next(model.parameters()).device)
    outs = []
    for a in row:
        mb = micro_batches[a.mb]
        hidden = link.recv(tag_of("F", a.mb, a.chunk - 1, n_chunks)) if a.chunk > 0 else None
        with compute_precision(h or Hyper(), mb[0].device):
            out = token_loss.forward(model, _targets(mb, a.chunk == n_chunks - 1), hidden=hidden,
                                     layers=chunks[a.chunk])
        if a.chunk == n_chunks - 1:
            outs.append(out)
        else:
            link.send(out, (a.chunk + 1) % p, tag_of("F", a.mb, a.chunk, n_chunks))
    link.finish()
    return outs


def pipeline_eval(model: torch.nn.Module, micro_batches, groups: ProcessGroups, stage: Stage,
                  sequence_parallel: bool, h: Hyper | None = None) -> torch.Tensor:
    """This stage's sum of the losses of `micro_batches` (0 off the last stage; of weighted micro-batches,
    raytp.train.token_loss, their weighted sum)."""
    outs = pipeline_forward(model, micro_batches, groups, stage, sequence_parallel, h)
    outs = [token_loss.scaled(o.float(), mb, 1) for o, mb in zip(outs, micro_batches)]
    return sum(outs, torch.zeros((), device=next(model.parameters()).device))


def sum_over_stages(t: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """`t` summed over this rank's pipeline group (in place; nothing to do at pp == 1)."""
    if groups.pp is not None:
        comm.all_reduce(t, groups.pp)
    return t
