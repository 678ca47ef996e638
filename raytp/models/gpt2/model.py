"""A GPT-2 in plain PyTorch, with no distributed code in it.

Architecturally GPT-2 (Radford et al. 2019): learned token + position
embeddings, pre-LayerNorm blocks of causal self-attention and a tanh-GELU MLP,
biases on every Linear, a final LayerNorm and an LM head tied to the token
embedding. Parameter names follow Hugging Face's GPT2LMHeadModel (minus the
``transformer.`` prefix) so weights move to and from that ecosystem.

Tensor parallelism is applied from outside (``raytp.models.shard.apply_tp`` with
raytp.models.gpt2.plan),
which swaps the Linear/Embedding/loss modules of a built model for parallel
ones. The code below is written so that the swap needs nothing else: head
counts are read off tensor shapes, the loss is a module, and the position
embedding is looked up through a module call.

Dropout is *keyed*: with a key set (``set_dropout_key``), each dropout site
draws its mask from a generator seeded by (key, site, head), never from the
global RNG. Then a sharded model draws, for the heads and positions it owns,
exactly the mask the one-device model draws, so dropout > 0 trains identically
at every TP degree and a replayed step reproduces bit for bit.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytp.initialization import InitRule
from raytp.models.args import ModelArgs
from raytp.models.base import CausalLM, LMLoss
from raytp.models.documents import attention_mask
from raytp.parallel.context.context_attention import ContextAttention
from raytp.seeds import derive_seed


class KeyedDropout(nn.Module):
    """Dropout whose mask is a pure function of (key, site) when a key is set.

    ``shard`` (set by the TP plan) says which slice of the full activation this
    rank holds, as (dim, index, count): the full mask is drawn and the local
    slice kept, so a sharded activation gets exactly the one-device mask and
    TP ranks holding different slices get different streams. Without a key it
    is ordinary dropout.
    """

    keyed_dropout = True  # raytp.models.base.set_dropout_key sets `key`

    def __init__(self, p: float, site: int):
        super().__init__()
        self.p, self.site = p, site
        self.key: int | None = None
        self.shard: tuple[int, int, int] | None = None

    def mask(self, shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        full = list(shape)
        if self.shard is not None:
            dim, _, count = self.shard
            full[dim] *= count
        g = torch.Generator(device=device).manual_seed(derive_seed(self.key, self.site))
        keep = torch.rand(full, generator=g, device=device) >= self.p
        if self.shard is not None:
            dim, index, _ = self.shard
            keep = keep.narrow(dim, index * shape[dim], shape[dim])
        return keep.to(dtype) / (1.0 - self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.key is None:
            return F.dropout(x, self.p, True)
        return x * self.mask(x.shape, x.device, x.dtype)


class CausalSelfAttention(nn.Module):
    keyed_dropout = True  # its attention-probability dropout is keyed per global head
    def __init__(self, cfg: ModelArgs, layer: int):
        super().__init__()
        self.head_dim = cfg.head_width
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v stacked
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.p = cfg.dropout
        self.site = 1000 * (layer + 1)
        self.key: int | None = None
        self.head_offset = 0  # global index of this shard's first head (set by the TP plan)
        self.resid_dropout = KeyedDropout(cfg.dropout, self.site + 1)
        self.context = ContextAttention()  # its sequences' other parts on a CP group, if bound to one

    def attention_dropout(self, att: torch.Tensor) -> torch.Tensor:
        if self.key is None:
            return F.dropout(att, self.p, True)
        B, nh, T, _ = att.shape
        keep = torch.empty_like(att, dtype=torch.bool)
        for h in range(nh):  # one stream per global head: the same at every TP degree
            seed = derive_seed(self.key, self.site, self.head_offset + h)
            g = torch.Generator(device=att.device).manual_seed(seed)
            keep[:, h] = torch.rand((B, T, T), generator=g, device=att.device) >= self.p
        return att * keep.to(att.dtype) / (1.0 - self.p)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents`: each position's document id (B, T), attention kept within each
        (raytp.models.documents); None = causal."""
        qkv = self.c_attn(x)  # (B, T, 3*nh*hs); nh = local heads, T = full length even if x is a slice of it
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)
        q = q.reshape(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.reshape(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.reshape(B, T, -1, self.head_dim).transpose(1, 2)
        if self.context.group is not None:  # this rank holds a part of each sequence (no attention dropout)
            y = self.context(q, k, v, documents)
        elif self.training and self.p > 0.0:
            # Explicit attention so the dropout mask is ours (keyed), not SDPA's.
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
            seen = (torch.ones(T, T, dtype=torch.bool, device=x.device).tril() if documents is None
                    else attention_mask(documents))
            att = att.masked_fill(~seen, float("-inf")).softmax(dim=-1)
            y = self.attention_dropout(att) @ v
        elif documents is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(documents))
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh*hs)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArgs, layer: int):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = KeyedDropout(cfg.dropout, 1000 * (layer + 1) + 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelArgs, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.mlp = MLP(cfg, layer)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), documents)
        return x + self.mlp(self.ln_2(x))


class PositionEmbedding(nn.Embedding):
    """Looks up positions 0..T-1 (T, C), or `positions` (B, T) -> (B, T, C); the TP plan swaps it for a
    sequence-sharded one."""

    def forward(self, T: int, positions: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(torch.arange(T, device=self.weight.device) if positions is None else positions)


def init_rule(name: str, cfg: ModelArgs) -> InitRule:
    """GPT-2's initialisation of parameter `name`: N(0, 0.02) for embeddings and weights, scaled by
    1/sqrt(2 n_layer) for the projections that write into the residual stream; zero biases; LayerNorms
    at (1, 0). The values themselves come from raytp.initialization (a function of seed and position)."""
    if ".ln_" in name or name.startswith("ln_f."):
        return InitRule("ones" if name.endswith(".weight") else "zeros")
    if name.endswith(".bias"):
        return InitRule("zeros")
    if name.endswith("c_proj.weight"):
        return InitRule("normal", 0.02 / math.sqrt(2 * cfg.n_layer))
    return InitRule("normal", 0.02)


class GPT(CausalLM):
    def __init__(self, cfg: ModelArgs, seed: int | None = None):
        """A GPT initialised from `seed` (default: a seed drawn from torch's global generator). Built on
        the meta device (``with torch.device("meta")``), it is shapes only and initialises nothing."""
        super().__init__()
        if cfg.arch != "gpt2":
            raise ValueError(f"GPT is arch gpt2, not {cfg.arch!r}: use raytp.models.registry.build_model")
        self.cfg = cfg
        self.build(seed, lambda: self._layers(cfg))

    def _layers(self, cfg: ModelArgs) -> None:
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = PositionEmbedding(cfg.block_size, cfg.n_embd)
        self.drop = KeyedDropout(cfg.dropout, 1)
        self.h = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layer)})  # keys: global layer indices
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # tied to wte, as in GPT-2
        self.criterion = LMLoss()

    def block_dict(self) -> nn.ModuleDict:
        return self.h

    @staticmethod
    def stage_parts() -> dict:
        """What only the first and only the last pipeline stage holds (raytp.models.stage)."""
        return {"first": ("wte", "wpe"), "last": ("ln_f", "lm_head", "criterion"), "embedding": "wte",
                "blocks": "h"}

    def input_embedding(self) -> nn.Module:
        return self.wte

    init_rule = staticmethod(init_rule)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, hidden: torch.Tensor | None = None,
                layers=None, documents: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """idx (B, T) token ids -> logits (B, T, V), or the mean loss when targets are given. A pipeline
        stage (raytp.models.stage) passes the residual stream it received as `hidden` and the layers to
        run as `layers`; it gets the residual stream back unless those layers end the model. `documents`:
        packed documents' ids (B, T) (raytp.models.documents): attention within each, positions restarting.
        `positions` (B, T): each token's position where not 0..T-1 (a CP rank's part of each sequence)."""
        T = self.check_length(idx)
        if hidden is None:  # (B, T, C)
            x = self.drop(self.wte(idx) + self.wpe(T, positions if positions is not None else
                                                  self.position_ids(documents)))
        else:
            x = hidden
        ids = self.document_ids(idx, documents)
        for block in self.blocks(layers):
            x = self.run_block(block, x, ids)
        if not self.ends_model(layers):
            return x
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return self.criterion(logits, targets) if documents is None else self.criterion(logits, targets, True)
