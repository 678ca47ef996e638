"""How each token picks its experts, and the router's auxiliary losses: pure functions of the router's
logits, the same on every rank that computes them.

- ``route``: softmax over the experts then the top k (Mixtral, Qwen-MoE), or a sigmoid per expert then
  the top k of the scores plus a selection bias (DeepSeek-V3; ``balance_bias``), the k weights renormalised
  to sum to 1 when ``norm_topk`` (Mixtral always), then times ``routed_scale``.
- ``balance_loss``: the load-balancing loss per sequence, E / (k T) * sum_i count_i * mean_t p_i (Switch's
  E * sum f_i P_i with f_i the share of the sequence's k T choices that went to expert i; DeepSeek-V3's
  sequence-wise form), averaged over the sequences. Being a mean over sequences, it is the same whichever
  data-parallel rank or micro-batch a sequence lands in: the gradient is equal at every layout (a global
  per-batch f_i would depend on how the batch is split). For one sequence transformers' Mixtral loss is k
  times this (its f_i counts each of the k slots over T); over a batch it counts the whole batch at once, so
  the ratio is only near k (1.95-2.0 at B = 1..8, k = 2): the export's router_aux_loss_coef = aux_coeff / k
  is the one-sequence match.
- ``z_loss``: mean over tokens of logsumexp(logits)^2 (ST-MoE's router z-loss).
"""
from __future__ import annotations

import math

import torch

from raytp.models.moe.args import MoeArgs


def route(logits: torch.Tensor, m: MoeArgs, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (N, E) float32 -> (weights (N, k) float32, experts (N, k) int64, scores (N, E): the
    probabilities the balance loss reads). `bias` (E,): added to a sigmoid router's scores to choose only."""
    if m.score == "softmax":
        scores = logits.softmax(dim=-1)
        weights, experts = scores.topk(m.top_k, dim=-1)
        if m.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        experts = (scores if bias is None else scores.detach() + bias).topk(m.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if m.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if m.routed_scale != 1.0:
        weights = weights * m.routed_scale
    return weights, experts, scores




def balance_loss(scores: torch.Tensor, experts: torch.Tensor, batch: int, m: MoeArgs, sequence=None
                 ) -> torch.Tensor:
    """The per-sequence load-balancing loss (see the module's text) of `batch` sequences whose tokens'
    scores (B*T, E) and chosen experts (B*T, k) are given in order; 1.0 when every expert gets its share.
    `sequence` (raytp.parallel.context.sequence_sum.SequenceSum): where context parallelism holds a part of each
    sequence here, the sums over its tokens are those of the whole sequence, from every part."""
    E, k = scores.shape[1], experts.shape[1]
    T = scores.shape[0] // batch
    chosen = torch.zeros(batch, E, device=scores.device, dtype=scores.dtype)
    chosen.scatter_add_(1, experts.reshape(batch, T * k), torch.ones(batch, T * k, device=scores.device,
                                                                      dtype=scores.dtype))
    p = scores.reshape(batch, T, E)
    if m.score == "sigmoid":  # DeepSeek-V3 normalises the sigmoid scores per token first
        p = p / (p.sum(dim=-1, keepdim=True) + 1e-20)
    if sequence is None or sequence.group is None:
        return (E / (k * T) * (chosen * p.mean(dim=1)).sum(dim=-1)).mean()
    T *= sequence.degree
    chosen, mean = sequence.counts(chosen), sequence(p.sum(dim=1)) / T
    return (E / (k * T) * (chosen * mean).sum(dim=-1)).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def within_capacity(experts: torch.Tensor, batch: int, m: MoeArgs, sequence=None) -> torch.Tensor | None:
    """Which of the choices (B*T, k) each expert takes under ``capacity_factor`` (None: all, dropless): per
    sequence, each expert's first ceil(T k / E * cf) choices in token order, (B*T, k) bool. `sequence`: as for
    balance_loss; the capacity and the order are then the whole sequence's."""
    if m.capacity_factor is None:
        return None
    N, k = experts.shape
    T = N // batch
    cut = sequence is not None and sequence.group is not None
    capacity = math.ceil(T * (sequence.degree if cut else 1) * k / m.n_experts * m.capacity_factor)
    hit = torch.nn.functional.one_hot(experts.reshape(batch, T * k), m.n_experts)  # (B, T k, E)
    ahead = sequence.earlier(hit) + _cumsum_per_chunk(hit) if cut else torch.cumsum(hit, dim=1)
    place = (ahead * hit).sum(-1)  # each choice's place among its expert's, from 1
    return (place <= capacity).reshape(N, k)


def _cumsum_per_chunk(hit: torch.Tensor) -> torch.Tensor:
    """Counts (B, L, E) along each of a CP rank's two chunks (raytp.parallel.context.sequence), each from its
    start: the chunks are apart in the sequence."""
    B, L, E = hit.shape
    return torch.cumsum(hit.reshape(B, 2, L // 2, E), dim=2).reshape(B, L, E)


def balance_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's update, in place: bias += rate * sign(mean load - load) (`load`: the step's choices per
    expert over every rank)."""
    bias += rate * torch.sign(load.float().mean() - load.float())
