"""One optimizer step of a TP x DP shard, in two parts: a schedule, then the finish.

The *schedule* runs this rank's micro-batches through forward and backward and
leaves their gradients accumulated in ``.grad``: the gradient-accumulation loop
(raytp.train.schedule) at pp == 1, a stage's row of a pipeline table at pp > 1.
The *finish* (``finish_step``) synchronises the gradients, clips them and updates
the weights; it is the same whatever schedule ran.

Gradient synchronisation happens once per step, after all micro-batches (the
DP part may start during the last backward passes: ``parallel.overlap_grad_reduce``):
- a tied embedding's copies on the first and the last stage are summed;
- DP: the loss (for reporting) is averaged over the DP group, and the
  gradients, laid out flat in buckets, are averaged by the optimizer
  (raytp.train.optimizer, raytp.train.grad_buckets): all-reduced, or
  reduce-scattered under the distributed optimizer (``parallel.zero`` 1),
  which then all-gathers the updated weights;
- then (after DP, as Megatron does, on the rows each DP rank updates) SP:
  replicated parameters that saw only this rank's slice of the sequence
  (LayerNorms, row-parallel biases, position embedding; tagged
  ``sequence_parallel`` by the TP plan) have their gradients summed over TP;
- shared KV heads (grouped-query attention at tp > n_kv_head; tagged
  ``shared_head``): each rank's copy saw only its own query heads, so the
  copies of a head have their gradients summed over the ranks sharing it
  (in the same all-reduce as SP's);
- an MoE layer's router (tagged ``partial_over_tp``): each TP rank's gradient
  came through its slice of the experts, so they are summed over TP too.
Clipping uses the global norm: each parameter's squares are summed over the
mesh axes its placement splits it along (TP; a shared head's once), replicated
ones counted once; with DP replicas
each DP rank sums the rows it owns and the sums are added over DP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raytp.models.moe.layer import set_aux_scale
from raytp.train.expert_load import balance_biases
from raytp.models.registry import placement_of
from raytp.models.stage import replicated_copy
from raytp.parallel import comm
from raytp.parallel.groups import ProcessGroups
from raytp.train.hyper import Hyper, compute_precision, lr_at
from raytp.train.optimizer import DistributedAdamW, make_optimizer  # noqa: F401 (make_optimizer: callers' import)
from raytp.train.stage_runner import pipeline_eval, sum_over_stages
from raytp.train import token_loss
from raytp.train.schedule import accumulate


def _flat_all_reduce(tensors: list[torch.Tensor], group, scale: float = 1.0) -> None:
    """All-reduce (sum, then * scale) a list of tensors in place, as one flat buffer."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, group)
    if scale != 1.0:
        flat *= scale
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t))


def _sum_over_tp(grads: list, group) -> None:
    """Sum over TP, in one all-reduce, the gradients TP ranks each hold a part of ([(parameter, gradient)]:
    the whole gradient, or the rows of it this DP rank owns, the same rows on every TP rank): SP-tagged
    ones, an MoE router's (``partial_over_tp``), and shared KV-head copies (each placed at its head's slot
    of a buffer of all heads, so the sum adds up the copies of each head and nothing else)."""
    sp = [g for p, g in grads if getattr(p, "sequence_parallel", False) or getattr(p, "partial_over_tp", False)]
    shared = []
    for p, g in grads:
        if hasattr(p, "shared_head"):
            head, heads, _ = p.shared_head
            buf = g.new_zeros((heads, *g.shape))
            buf[head] = g
            shared.append((g, head, buf))
    _flat_all_reduce(sp + [buf for _, _, buf in shared], group)
    for g, head, buf in shared:
        g.copy_(buf[head])


def global_grad_norm(model: torch.nn.Module, groups: ProcessGroups, optimizer: DistributedAdamW | None = None
                     ) -> torch.Tensor:
    """The norm of the whole model's gradient: each parameter's squares summed over the mesh axes that
    split it (its placement, raytp.models.registry.placement_of; a shared head's once), over the pipeline
    stages, and a tied embedding's second copy left out (raytp.models.stage). With DP replicas and
    `optimizer`, each DP rank sums the rows it owns (raytp.train.optimizer) and the sums are added over DP:
    the same at zero 0 and zero 1. Experts on a mesh of their own are summed whole on each expert-DP rank, or,
    cut over expert-DP by the distributed optimizer, by rows added over expert-DP (the same to rounding)."""
    lay = groups.layout

    def split(name: str) -> tuple[str, ...]:
        return tuple(a for a in placement_of(name, model.cfg, lay).split_axes if a not in ("dp", "edp"))

    # The axes that split a parameter -> its squares; every rank lists the same keys (a DP rank may own
    # rows of some kinds only), split ones first, so the sums meet in one order everywhere.
    by_axes = {k: [] for k in sorted({("tp",), ()} | {split(n) for n, _ in model.named_parameters()},
                                     key=lambda axes: (-len(axes), axes))}
    over_grad = optimizer is not None and groups.grad is not None
    grads = optimizer.owned_grads() if over_grad else ((n, p, p.grad) for n, p in model.named_parameters())
    for name, p, g in grads:
        if g is not None and not replicated_copy(model, name):
            sq = g.float().pow(2).sum()
            if hasattr(p, "shared_head"):
                by_axes[("tp",)].append(sq / p.shared_head[2])  # held by that many ranks: counted once
            else:
                by_axes[split(name)].append(sq)
    device = next(model.parameters()).device
    sums = [torch.stack(v).sum() if v else torch.zeros((), device=device) for v in by_axes.values()]
    if over_grad:
        both = torch.stack(sums)
        comm.all_reduce(both, groups.grad)
        sums = list(both.unbind())
        # experts: whole on each expert-DP replica (not summed over DP), or each rank's rows summed over expert-DP
        part = sums if not optimizer.apart_sharded else [torch.zeros((), device=device) for _ in sums]
        for name, p, g in optimizer.apart_grads():
            at = list(by_axes).index(split(name))
            part[at] = part[at] + g.float().pow(2).sum()
        if optimizer.apart_sharded:
            part = torch.stack(part)
            comm.all_reduce(part, groups.group("edp"))
            sums = [s + q for s, q in zip(sums, part.unbind())]
    total = None
    for axes, sq in zip(by_axes, sums):
        for axis in axes:
            if groups.group(axis) is not None:
                comm.all_reduce(sq, groups.group(axis))
        total = sq if total is None else total + sq
    return sum_over_stages(total, groups).sqrt()


@dataclass
class StepResult:
    loss: float        # mean loss over the global batch (over its trained tokens, of packed documents)
    grad_norm: float   # before clipping
    lr: float
    loss_tokens: int | None = None  # the global batch's trained tokens (None: every target, pretraining)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches, groups: ProcessGroups,
               step: int, h: Hyper, before_update=None, schedule=None) -> StepResult:
    """One optimizer step over this rank's micro-batches [(x, y), ...] of global step `step`: `schedule`
    (default: raytp.train.schedule.accumulate), then finish_step. `before_update`: see finish_step. With an
    optimizer that overlaps, the DP reduction starts during the schedule's last backward passes."""
    model.train()
    set_aux_scale(model, 1.0 / len(micro_batches))  # MoE auxiliary losses weigh as each micro-batch's loss
    optimizer.zero_grad(set_to_none=False)  # the same buffers every step: no allocator churn
    optimizer.follow(groups.layout.grad_degree, groups.grad_rank)
    edp = groups.group("edp") if groups.layout.experts_split else None  # experts' gradients: over expert-DP
    if (groups.grad is not None or edp is not None) and getattr(optimizer, "overlap", False):
        tied = [model.input_embedding().weight] if groups.emb is not None and model.cfg.tied else []
        optimizer.arm(groups.grad, len(micro_batches), hold=tied, apart_group=edp)  # a tied copy waits (its sum)
    micro_batches, tokens = token_loss.weighted(micro_batches, groups)  # packed documents: by trained tokens
    local_loss = (schedule or accumulate)(model, micro_batches, groups, step, h)
    r = finish_step(model, optimizer, groups, step, h, local_loss, before_update)
    r.loss_tokens = tokens
    return r


def finish_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: ProcessGroups, step: int,
                h: Hyper, local_loss: torch.Tensor, before_update=None) -> StepResult:
    """Sync the gradients a schedule left in ``.grad`` (a tied embedding's two copies summed, the DP mean
    with the loss, then the TP sums), clip by the global norm, and update. `local_loss`: this rank's mean
    loss over its micro-batches. `before_update`: called right before the weights and optimizer state
    change (the optimizer's step); until then they are only read, so a snapshot of them may still be
    being copied. The step's last collective comes before it (the caller's own, such as a record's gather,
    go in `before_update`): after it nothing fails with a peer's loss but zero 1's gather of the new
    weights, so a rank holds the state before the step or after it, or knows it holds neither
    (raytp.runtime.worker.worker: ``torn``)."""
    if groups.emb is not None and model.cfg.tied:  # the first and the last stage's copies of the embedding
        comm.all_reduce(model.input_embedding().weight.grad, groups.emb)
    mean_loss = sum_over_stages(local_loss.detach().reshape(1), groups)  # the last stage's, on every stage
    optimizer.follow(groups.layout.grad_degree, groups.grad_rank)
    if groups.grad is not None:  # the loss, then the gradients in buckets (reduce-scattered under zero 1)
        comm.all_reduce(mean_loss, groups.grad)
        mean_loss /= groups.layout.grad_degree
        optimizer.reduce_gradients(groups.grad, 1.0 / groups.layout.grad_degree)
    if groups.layout.experts_split:  # experts over their own mesh: summed over expert-DP, DP's mean scale
        optimizer.reduce_apart(groups.group("edp"), 1.0 / groups.layout.grad_degree)
    if groups.tp is not None:  # after the DP sum (Megatron's order), so DP buckets need not wait for it
        _sum_over_tp(list(optimizer.update_grads()), groups.tp)

    move_biases = balance_biases(model, groups)  # sigmoid routers' selection biases, moved with the update
    norm = global_grad_norm(model, groups, optimizer)
    if h.grad_clip > 0:
        optimizer.scale_gradients(torch.clamp(h.grad_clip / (norm + 1e-6), max=1.0))
    lr = lr_at(step, h)
    for g in optimizer.param_groups:
        g["lr"] = lr
    if before_update is not None:
        before_update()
    move_biases()  # the state changes from here on only: a failed collective before it left the step undone
    optimizer.step(groups.grad)  # under zero 1 also gives every replica the new weights
    return StepResult(float(mean_loss), float(norm), lr)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, micro_batches, groups: ProcessGroups, h: Hyper | None = None,
              pipeline=None) -> float:
    """Mean loss over this rank's batches, averaged over DP (in the precision of `h`, if given).
    `pipeline`: the PipelineSchedule of a pipeline stage (raytp.train.stage_runner): its forwards only."""
    model.eval()
    micro_batches, tokens = token_loss.weighted(micro_batches, groups)
    n = len(micro_batches) if tokens is None else 1  # weighted ones sum to the rank's share
    if pipeline is not None:
        total = pipeline_eval(model, micro_batches, groups, pipeline.stage, pipeline.sp, h).reshape(1)
        total = sum_over_stages(total, groups) / n
    elif tokens is None:
        with compute_precision(h or Hyper(), micro_batches[0][0].device):
            total = torch.stack([token_loss.forward(model, mb).float() for mb in micro_batches]).mean().reshape(1)
    else:
        with compute_precision(h or Hyper(), micro_batches[0][0].device):
            total = torch.stack([token_loss.scaled(token_loss.forward(model, mb).float(), mb, 1)
                                 for mb in micro_batches]).sum().reshape(1)
    if groups.grad is not None:
        comm.all_reduce(total, groups.grad)
        total /= groups.layout.grad_degree
    model.train()
    return float(total)
