"""ModelArgs: the shape of a model of any architecture raytp knows (raytp.models.registry names them).

One frozen value, written into checkpoint manifests and model files as a dict,
read back by ``ModelArgs(**d)``. The keys after ``dropout`` are for the
architectures that have them (a Llama's grouped-query heads, SwiGLU width,
rotary base, untied head, norm epsilon); an architecture that fixes one (GPT-2
ties its head and has no KV grouping) says so in ``FIXED`` below, its only
architecture-specific knowledge, so that the derived figures are right for it.
"""
from __future__ import annotations

from dataclasses import dataclass

# What an architecture fixes, whatever the keys say: GPT-2 has no KV grouping, a 4x MLP and a tied head.
FIXED: dict[str, dict] = {"gpt2": {"n_kv_head": None, "intermediate_size": None, "tie_embeddings": True}}


@dataclass(frozen=True)
class ModelArgs:
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
    tie_embeddings: bool = False
    norm_eps: float = 1e-5

    def _get(self, key: str):
        fixed = FIXED.get(self.arch, {})
        return fixed[key] if key in fixed else getattr(self, key)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self._get("n_kv_head") or self.n_head

    @property
    def mlp_width(self) -> int:
        return self._get("intermediate_size") or 4 * self.n_embd

    @property
    def tied(self) -> bool:
        return bool(self._get("tie_embeddings"))
