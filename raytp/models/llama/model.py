"""A Llama in plain PyTorch, with no distributed code in it (Llama 2/3, Mistral, Qwen, SmolLM shapes).

Architecturally Touvron et al. 2023: a token embedding, pre-RMSNorm blocks of
causal self-attention with rotary position embedding (Su et al. 2021, base
``rope_theta``; Llama 3.1+'s frequency rescaling with ``rope_scaling``) and
grouped-query attention (``n_kv_head`` key/value heads, each shared by
n_head / n_kv_head query heads; Ainslie et al. 2023), a SwiGLU MLP
(down(silu(gate(x)) * up(x))) or, in the layers ``moe`` names, a Mixture-of-
Experts layer of SwiGLU experts (raytp.models.moe: Mixtral, Qwen-MoE,
DeepSeek-style routers), no biases, a final RMSNorm and an output head,
untied from the embedding unless ``tie_embeddings``. Parameter names and
numerics follow Hugging Face's LlamaForCausalLM (minus the ``model.`` prefix),
so its checkpoints load as they are.

As in raytp.models.gpt2, tensor parallelism is applied from outside: head counts
are read off tensor shapes, and each attention and MLP block passes its input
through ``tp_in`` (an identity here) before its projections, where the TP plan
puts the one collective the three (or two) column-parallel projections share.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytp.initialization import InitRule
from raytp.models.args import ModelArgs, RopeScaling
from raytp.models.base import CausalLM, LMLoss
from raytp.models.documents import attention_mask
from raytp.models.moe.layer import MoE
from raytp.parallel.context.context_attention import ContextAttention


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as transformers' LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None, device=None) -> torch.Tensor:
    """The rotary frequencies (head_dim / 2,) theta^(-2i/head_dim), rescaled as Llama 3.1+ does when
    `scaling` is given: a wavelength 2 pi / f longer than the original context / low_freq_factor is
    stretched factor times (f / factor), one shorter than original / high_freq_factor kept, and those
    between interpolated, (1 - s) f / factor + s f with s = (original / wavelength - low) / (high - low).
    The same float32 operations as transformers' _compute_llama3_parameters, so the same bits."""
    f = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if scaling is None:
        return f
    original, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / f
    stretched = torch.where(wavelen > original / low, f / scaling.factor, f)
    s = (original / wavelen - low) / (high - low)
    between = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(between, (1 - s) * stretched / scaling.factor + s * stretched, stretched)


def rotary(T: int, head_dim: int, theta: float, device, scaling: RopeScaling | None = None,
           positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, head_dim) of positions 0..T-1 (the two halves of head_dim rotate together); of
    `positions` (B, T) instead, (B, 1, T, head_dim): documents packed in a row each start at 0
    (raytp.models.documents.positions)."""
    f = inv_freq(head_dim, theta, scaling, device)
    if positions is None:
        freqs = torch.outer(torch.arange(T, device=device).float(), f)
    else:
        freqs = positions.float()[..., None] * f  # (B, T, head_dim / 2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos(), emb.sin()) if positions is None else (emb.cos()[:, None], emb.sin()[:, None])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArgs):
        super().__init__()
        hd = self.head_dim = cfg.head_width
        self.tp_in = nn.Identity()
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_head * hd, cfg.n_embd, bias=False)
        if cfg.qk_norm:  # Qwen3: an RMSNorm over each head of q and of k, before the rotation
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.norm_eps), RMSNorm(hd, cfg.norm_eps)
        self.context = ContextAttention()  # its sequences' other parts on a CP group, if bound to one

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents`: each position's document id (B, T) (raytp.models.documents); None = causal."""
        x = self.tp_in(x)  # (B, T, C), the full sequence even under sequence parallelism
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd); local heads
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.context.group is not None:  # this rank holds a part of each sequence (context parallelism)
            return self.o_proj(self.context(q, k, v, documents).transpose(1, 2).reshape(B, T, -1))
        group = q.shape[1] // k.shape[1]  # query heads per KV head
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = (F.scaled_dot_product_attention(q, k, v, is_causal=True) if documents is None else
             F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(documents)))
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelArgs):
        super().__init__()
        self.tp_in = nn.Identity()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_width, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tp_in(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MoE(cfg.n_embd, cfg.moe) if cfg.moe is not None and cfg.moe.is_moe(layer) else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, documents)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(CausalLM):
    """A Llama initialised from `seed` (see raytp.models.gpt2.model.GPT for seeds and the meta device)."""

    def __init__(self, cfg: ModelArgs, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.build(seed, lambda: self._layers(cfg))

    def _layers(self, cfg: ModelArgs) -> None:
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layer)})  # keys: global layer indices
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.criterion = LMLoss()

    def block_dict(self) -> nn.ModuleDict:
        return self.layers

    @staticmethod
    def stage_parts() -> dict:
        """What only the first and only the last pipeline stage holds (raytp.models.stage)."""
        return {"first": ("embed_tokens",), "last": ("norm", "lm_head", "criterion"), "embedding": "embed_tokens",
                "blocks": "layers"}

    def input_embedding(self) -> nn.Module:
        return self.embed_tokens

    @staticmethod
    def init_rule(name: str, cfg: ModelArgs) -> InitRule:
        """N(0, 0.02) for embeddings and projections (transformers' initializer_range), scaled by
        1/sqrt(2 n_layer) for the two that write into the residual stream; RMSNorms at 1."""
        if name.endswith("norm.weight"):  # the blocks' and q/k heads' RMSNorms
            return InitRule("ones")
        if name.endswith(("expert_bias", "_proj.bias")):  # a router's selection bias; Qwen2's q/k/v biases
            return InitRule("zeros")
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return InitRule("normal", 0.02 / math.sqrt(2 * cfg.n_layer))
        return InitRule("normal", 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, hidden: torch.Tensor | None = None,
                layers=None, documents: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """idx (B, T) token ids -> logits (B, T, V), or the mean loss when targets are given (`hidden`,
        `layers`: a pipeline stage's, see raytp.models.gpt2.model.GPT.forward; `documents`: packed documents'
        ids (B, T), raytp.models.documents: attention within each, rotary positions restarting at each;
        `positions` (B, T): each token's position where not 0..T-1, a CP rank's part of each sequence)."""
        T = self.check_length(idx)
        cos, sin = rotary(T, self.cfg.head_width, self.cfg.rope_theta, idx.device, self.cfg.rope_scaling,
                          positions if positions is not None else self.position_ids(documents))
        x = self.embed_tokens(idx) if hidden is None else hidden  # (B, T, C); (B, T/tp, C) under SP
        ids = self.document_ids(idx, documents)
        for block in self.blocks(layers):
            x = self.run_block(block, x, cos, sin, ids)
        if not self.ends_model(layers):
            return x
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return self.criterion(logits, targets) if documents is None else self.criterion(logits, targets, True)
