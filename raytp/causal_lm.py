"""What raytp's models share: the shape config (either architecture), seeded init, tied heads, files.

``GPTConfig`` describes a GPT-2 (raytp.model) or a Llama (raytp.llama) by its
``arch``; ``CausalLM`` is their common base: every parameter gets its seeded
values from raytp.initialization (so a TP shard can compute its slices alone),
a tied head shares the input embedding's weight, and a model reads and writes
the one-device file `raytp export` makes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from raytp.initialization import InitRule, no_init, values

MODEL_FORMAT, MODEL_FORMAT_V1 = "raytp-model/2", "raytp-model/1"  # 2: safetensors; 1: a torch pickle


@dataclass(frozen=True)
class GPTConfig:
    """A model's shape, for either architecture (`arch`: "gpt2", this file's model, or "llama",
    raytp.llama's). The keys after dropout are Llama's; GPT-2 ignores them."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    vocab_size: int = 256
    dropout: float = 0.0
    arch: str = "gpt2"
    n_kv_head: int | None = None           # None: n_head (no grouping)
    intermediate_size: int | None = None   # None: 4 * n_embd
    rope_theta: float = 10000.0
    tie_embeddings: bool = False           # GPT-2 always ties
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.arch == "gpt2" or self.n_kv_head is None else self.n_kv_head

    @property
    def mlp_width(self) -> int:
        return 4 * self.n_embd if self.arch == "gpt2" or self.intermediate_size is None else self.intermediate_size

    @property
    def tied(self) -> bool:
        return self.arch == "gpt2" or self.tie_embeddings


def model_class(cfg: GPTConfig) -> type["CausalLM"]:
    """The model of `cfg.arch`: GPT (this file) or raytp.llama's Llama."""
    if cfg.arch == "gpt2":
        from raytp.model import GPT
        return GPT
    if cfg.arch == "llama":
        from raytp.llama import Llama
        return Llama
    raise ValueError(f"model.arch: {cfg.arch!r} is not one of gpt2, llama")


def build_model(cfg: GPTConfig, seed: int | None = None) -> "CausalLM":
    return model_class(cfg)(cfg, seed)


class CausalLM(nn.Module):
    """What GPT and Llama share: seeded init of every parameter, the tied head, files, generation."""

    cfg: GPTConfig
    lm_head: nn.Linear
    activation_checkpointing = False  # recompute each block in backward (train.activation_checkpointing)

    @staticmethod
    def init_rule(name: str, cfg: GPTConfig) -> InitRule:
        raise NotImplementedError

    def input_embedding(self) -> nn.Module:
        raise NotImplementedError

    def build(self, seed: int | None, make_layers) -> None:
        """Make the modules (`make_layers()`, which allocates but initialises nothing), tie the head,
        and give every parameter its seeded values; on the meta device, shapes only."""
        with no_init():
            make_layers()
        if self.cfg.tied:
            self.lm_head.weight = self.input_embedding().weight
        if self.lm_head.weight.is_meta:
            return
        if seed is None:
            seed = int(torch.randint(2**62, (1,), device="cpu"))
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(values(name, self.init_rule(name, self.cfg), seed, tuple(p.shape)))

    def run_block(self, block: nn.Module, *args) -> torch.Tensor:
        """block(*args), its activations recomputed in backward when activation checkpointing is on
        (the recomputation draws the same keyed dropout masks, so results are bitwise the same)."""
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def check_length(self, idx: torch.Tensor) -> int:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.cfg.block_size}")
        return T

    @classmethod
    def load(cls, path, map_location="cpu") -> "CausalLM":
        """The model in a file written by `raytp export` (one device, no Ray, no process group): a
        safetensors file whose metadata holds the config (format 2; either arch), or a format-1 torch file."""
        with open(path, "rb") as f:
            head = f.read(9)
        if len(head) == 9 and head[8:9] == b"{":  # safetensors: an 8-byte length, then the JSON header
            from safetensors import safe_open
            with safe_open(str(path), framework="pt", device=str(map_location)) as f:
                meta = f.metadata() or {}
                if meta.get("format") != MODEL_FORMAT:
                    raise ValueError(f"{path}: not a raytp model file (format {MODEL_FORMAT!r})")
                state = {k: f.get_tensor(k) for k in f.keys()}
            cfg = GPTConfig(**json.loads(meta["config"]))
            return model_class(cfg).from_state_dict(cfg, state, where=str(path)).eval()
        blob = torch.load(path, map_location=map_location, weights_only=True)
        if not isinstance(blob, dict) or blob.get("format") != MODEL_FORMAT_V1:
            raise ValueError(f"{path}: not a raytp model file (format {MODEL_FORMAT!r})")
        return model_class(GPTConfig()).from_state_dict(GPTConfig(**blob["config"]), blob["model"], where=str(path)).eval()

    @classmethod
    def from_state_dict(cls, cfg: GPTConfig, state: dict, where: str = "state") -> "CausalLM":
        """A model holding `state` (a tied lm_head.weight may be absent), built without an init."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device="cpu")
        if cfg.tied:
            model.lm_head.weight = model.input_embedding().weight  # to_empty made two tensors of the tied one
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (cfg.tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"{where}: weights do not fit the model: missing {missing}, unexpected {unexpected}")
        return model

    def save(self, path) -> None:
        """Write this (one-device) model as a file `load` reads (safetensors)."""
        from safetensors.torch import save_file
        state = {k: v.contiguous() for k, v in self.state_dict().items()
                 if not (self.cfg.tied and k == "lm_head.weight")}
        save_file(state, str(path), metadata={"format": MODEL_FORMAT, "config": json.dumps(asdict(self.cfg))})

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append `tokens` sampled tokens to idx (B, T); temperature 0 is greedy."""
        for _ in range(tokens):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :]  # (B, V)
            if temperature == 0.0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
