"""An MoE feed-forward layer (Mixtral's SparseMoeBlock, Qwen-MoE's with a shared expert, DeepSeek's router):
a router, ``n_experts`` SwiGLU experts each token reaches ``top_k`` of, and optional shared experts every
token goes through. Plain PyTorch; tensor parallelism is applied from outside (raytp.models.moe.plan).

Each expert is its own module with two-dimensional weights under its global index
(``experts.<j>.gate_proj.weight``), as transformers' checkpoints name them: the model's files, checkpoints and
the TP split of an expert are those of a dense SwiGLU MLP (Megatron's SequentialMLP). ``dispatch``
(raytp.parallel.expert_dispatch) runs the experts one after another on the tokens routed to them, sending
them over the expert-parallel group to the rank holding each expert where there is one; every expert runs
each step, on no rows when none chose it, so each of its parameters gets a gradient every step.

The router runs in float32 on the whole sequence. Its auxiliary losses (raytp.models.moe.routing: balance
and z, weighted by ``aux_coeff`` and ``z_coeff``) never join the language-model loss that is reported:
``AuxLoss`` hands their gradient to the router in backward, weighted as the step weighs this micro-batch's
loss (``aux_scale``, set by raytp.train.step) and shared among the TP ranks that each compute it whole (their
router gradients are summed over TP), so the gradient is the same at every layout and on any pipeline stage
(Megatron's MoEAuxLossAutoScaler). Under context parallelism the balance loss's per-sequence sums come from
every CP rank's part of the sequence (``sequence``: raytp.parallel.context.sequence_sum); the z loss, a mean
over tokens, needs nothing (each rank's mean over its equal share, averaged by the step's DP x CP mean).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytp.models.moe.args import MoeArgs
from raytp.models.moe.routing import balance_loss, route, within_capacity, z_loss
from raytp.parallel import comm
from raytp.parallel.context.sequence_sum import SequenceSum
from raytp.models.moe.grouped import run_experts
from raytp.parallel.expert_dispatch import ExpertDispatch, per_expert


class Expert(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x)), no biases (the names of Qwen-MoE's experts)."""

    def __init__(self, n_embd: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(n_embd, width, bias=False)
        self.up_proj = nn.Linear(n_embd, width, bias=False)
        self.down_proj = nn.Linear(width, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AuxLoss(torch.autograd.Function):
    """Returns x unchanged; in backward gives `loss` the gradient `scale` (the loss's weight in the step),
    so the auxiliary losses need no path of their own through the pipeline."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.like = scale, loss.detach()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full_like(ctx.like, ctx.scale), None


class MoE(nn.Module):
    def __init__(self, n_embd: int, m: MoeArgs):
        super().__init__()
        self.args = m
        self.tp_in, self.tp_out = nn.Identity(), nn.Identity()  # the TP entry and exit collectives (plan.py)
        self.gate = nn.Linear(n_embd, m.n_experts, bias=False)
        # by global index; with expert parallelism a rank keeps its own (raytp.models.moe.plan)
        self.experts = nn.ModuleDict({str(j): Expert(n_embd, m.moe_ffn) for j in range(m.n_experts)})
        self.dispatch = ExpertDispatch(m.n_experts)  # over the EP group, once the plan gives it one
        self.token_share = False  # True: this TP rank runs its share of the tokens only (experts whole per rank)
        self.shared_expert = Expert(n_embd, m.shared_width) if m.n_shared else None
        self.shared_expert_gate = nn.Linear(n_embd, 1, bias=False) if m.shared_gate else None
        self.aux_scale = 1.0  # this micro-batch's weight in the step's loss (set_aux_scale)
        self.sequence = SequenceSum()  # the balance loss's sums over a sequence cut over CP ranks
        self.stats = RoutingStats()
        if m.bias_rate:  # a state of the model, not trained by gradients: checkpointed as a weight
            self.expert_bias = nn.Parameter(torch.zeros(m.n_experts), requires_grad=False)
            self.step_load: torch.Tensor | None = None  # choices per expert in this step (balance_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tp_in(x)  # (B, T, C): the whole sequence, also under sequence parallelism
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        with torch.autocast(flat.device.type, enabled=False):  # float32 under bf16 autocast too
            logits = F.linear(flat.float(), self.gate.weight.float())  # (N, E)
        weights, experts, scores = route(logits, self.args, getattr(self, "expert_bias", None))
        kept = within_capacity(experts, B, self.args, self.sequence)  # None: dropless
        out = self._routed(flat, weights, experts, kept)  # (N, C): partial over TP, or this TP rank's rows only
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        y = self.tp_out(out.view(B, T, C))  # this TP rank's part of every expert summed over TP
        if not self.training:
            return y
        m = self.args
        balance, z = balance_loss(scores, experts, B, m, self.sequence), z_loss(logits)
        if torch._C._current_graph_task_id() == -1:  # not a recomputation in backward (activation checkpointing)
            load = per_expert(experts, m.n_experts)
            self.stats.add(load, balance, z, 0 if kept is None else int((~kept).sum()))
            if m.bias_rate:
                self.step_load = load if self.step_load is None else self.step_load + load
        if (m.aux_coeff or m.z_coeff) and torch.is_grad_enabled():
            aux = m.aux_coeff * balance + m.z_coeff * z
            y = AuxLoss.apply(y, aux, self.aux_scale / comm.group_size(getattr(self.tp_out, "group", None)))
        return y

    def _routed(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                kept: torch.Tensor | None) -> torch.Tensor:
        """sum over each token's experts (those `kept` within capacity) of weight * expert(token): every token's,
        or, when the TP ranks hold whole experts (``token_share``), this TP rank's share of the tokens, the
        other rows zero (the exit collective's sum over TP puts the shares together)."""
        n, k = experts.shape
        tokens = torch.arange(n, device=flat.device).repeat_interleave(k)
        experts, weights = experts.reshape(-1), weights.reshape(-1)
        mine = None if kept is None else kept.reshape(-1)
        if self.token_share:
            group = self.tp_out.group
            tp, r = comm.group_size(group), comm.group_rank(group)
            share = (tokens >= n * r // tp) & (tokens < n * (r + 1) // tp)
            mine = share if mine is None else mine & share
        if mine is not None:
            tokens, experts, weights = tokens[mine], experts[mine], weights[mine]
        local = [self.experts[str(self.dispatch.first + j)] for j in range(self.dispatch.local)]
        return self.dispatch(flat, tokens, experts, weights, lambda rows, sizes: run_experts(rows, sizes, local))


class RoutingStats:
    """What a layer's router did in training forwards since the last ``take``: tokens per expert, and the sums
    of the balance and z losses with the number of forwards they came from (detached)."""

    def __init__(self):
        self.load, self.balance, self.z, self.forwards, self.dropped = None, 0.0, 0.0, 0, 0

    def add(self, load: torch.Tensor, balance: torch.Tensor, z: torch.Tensor, dropped: int = 0) -> None:
        self.load = load if self.load is None else self.load + load
        self.balance, self.z = self.balance + balance.detach(), self.z + z.detach()
        self.forwards += 1
        self.dropped += dropped

    def take(self, n_experts: int) -> tuple[torch.Tensor, float, float, int, int]:
        """(choices per expert, balance loss sum, z loss sum, forwards, choices dropped), and start again."""
        load = self.load if self.load is not None else torch.zeros(n_experts, dtype=torch.long)
        out = (load, float(self.balance), float(self.z), self.forwards, self.dropped)
        self.__init__()
        return out


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """Weigh the auxiliary losses of the next backward passes by `scale` (1 / micro-batches per step)."""
    for m in moe_layers(model):
        m.aux_scale = scale
