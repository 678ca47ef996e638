"""ModelArgs: the shape of a model of any architecture raytp knows (raytp.models.registry names them).

One frozen value, written into checkpoint manifests and model files as a dict,
read back by ``ModelArgs(**d)``. The keys after ``dropout`` are for the
architectures that have them (a Llama's grouped-query heads, SwiGLU width,
rotary base and its Llama 3 rescaling, untied head, norm epsilon, expert
layers); an
architecture that fixes one (GPT-2 ties its head and has no KV grouping) says
so in ``FIXED`` below, its only architecture-specific knowledge, so that the
derived figures are right for it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from raytp.models.moe.args import MoeArgs

# What an architecture fixes, whatever the keys say: GPT-2 has no KV grouping, a 4x MLP and a tied head.
FIXED: dict[str, dict] = {"gpt2": {"n_kv_head": None, "intermediate_size": None, "tie_embeddings": True}}


ROPE_TYPES = ("llama3",)  # rotary rescalings raytp implements (transformers' rope_type names)


def _unsupported(rope_type) -> str:
    return f"rope_type {rope_type!r} is not supported; valid: {', '.join(ROPE_TYPES)}"


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rescaling of the rotary frequencies (Llama 3.1+; transformers' ``rope_type: llama3``):
    wavelengths above original_max_position_embeddings / low_freq_factor are stretched ``factor`` times,
    those below original_max_position_embeddings / high_freq_factor kept, those between interpolated.
    Checks itself: an invalid one cannot be made (ValueError naming every bad field)."""
    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        problems = []
        if self.rope_type not in ROPE_TYPES:
            problems.append(_unsupported(self.rope_type))
        numbers = {"factor": float, "low_freq_factor": float, "high_freq_factor": float,
                   "original_max_position_embeddings": int}
        for name, kind in numbers.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
                problems.append(f"{name}: expected {'a number' if kind is float else 'an integer'}, got {v!r}")
            else:
                object.__setattr__(self, name, kind(v))  # 8 and 8.0 are one value
        if not problems:
            if not self.factor >= 1:
                problems.append(f"factor: {self.factor:g} must be >= 1")
            if not self.low_freq_factor > 0:
                problems.append(f"low_freq_factor: {self.low_freq_factor:g} must be > 0")
            if not self.high_freq_factor > self.low_freq_factor:
                problems.append(f"high_freq_factor: {self.high_freq_factor:g} must exceed "
                                f"low_freq_factor={self.low_freq_factor:g}")
            if self.original_max_position_embeddings < 1:
                problems.append(f"original_max_position_embeddings: {self.original_max_position_embeddings} "
                                "must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def parse(cls, value: Any) -> RopeScaling:
        """One from a mapping of exactly its fields (a job file's, a manifest's); ValueError naming what is
        unknown, missing or invalid."""
        if isinstance(value, cls):
            return value
        names = [f.name for f in fields(cls)]
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping of {', '.join(names)}, got {value!r}")
        if value.get("rope_type", ROPE_TYPES[0]) not in ROPE_TYPES:  # alone: its fields are another type's
            raise ValueError(_unsupported(value["rope_type"]))
        problems = [f"unknown field {k!r}; valid: {', '.join(names)}" for k in value if k not in names]
        missing = [n for n in names if n not in value]
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**value)


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
    rope_scaling: RopeScaling | None = None  # None: unscaled rotary embedding
    moe: MoeArgs | None = None               # None: every MLP dense (raytp.models.moe.args)
    head_dim: int | None = None              # None: n_embd / n_head (Qwen3's may differ): see head_width
    qk_norm: bool = False                    # an RMSNorm over each query and key head (Qwen3)
    qkv_bias: bool = False                   # biases on the query, key and value projections (Qwen2)

    def __post_init__(self):
        if self.rope_scaling is not None:  # read back from a manifest's or model file's dict
            object.__setattr__(self, "rope_scaling", RopeScaling.parse(self.rope_scaling))
        if self.moe is not None:
            object.__setattr__(self, "moe", MoeArgs.parse(self.moe))

    def _get(self, key: str):
        fixed = FIXED.get(self.arch, {})
        return fixed[key] if key in fixed else getattr(self, key)

    @property
    def head_width(self) -> int:
        """The width of each attention head: head_dim, else n_embd / n_head."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self._get("n_kv_head") or self.n_head

    @property
    def mlp_width(self) -> int:
        return self._get("intermediate_size") or 4 * self.n_embd

    @property
    def tied(self) -> bool:
        return bool(self._get("tie_embeddings"))
