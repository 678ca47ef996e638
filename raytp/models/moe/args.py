"""MoeArgs: the shape of a model's Mixture-of-Experts layers (a job's ``model.moe``), torch-free.

Which layers are MoE: layer i (0-based) is one when i >= ``first_dense`` (DeepSeek's
first_k_dense_replace) and (i + 1) is a multiple of ``moe_every`` (Qwen-MoE's decoder_sparse_step);
the others keep the dense SwiGLU MLP of ``model.intermediate_size``. Every MoE layer has ``n_experts``
SwiGLU experts of width ``moe_ffn``, each token sent to ``top_k`` of them by a router, and, with
``n_shared`` > 0, a shared SwiGLU of width n_shared * shared_ffn that every token goes through (scaled
by a sigmoid gate per token when ``shared_gate``, as Qwen2-MoE's). Dropless unless ``capacity_factor``:
then each expert takes at most ceil(T * top_k / n_experts * capacity_factor) of a sequence's choices, those of
the earliest tokens, each token's choices kept together (Megatron's "position" drop policy; GShard takes every
token's first choice before any second one), per sequence so that what is dropped does not depend on how the
batch is split; the dropped choices add nothing. With ``bias_rate`` (sigmoid routers,
DeepSeek-V3's auxiliary-loss-free balancing) a per-expert bias is added to the scores to choose the experts,
not to weigh them, and after every step moves by bias_rate toward balance: + where an expert got fewer
choices than the mean over the whole step, - where more.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoeArgs:
    """A model's expert layers. Checks itself: an invalid one cannot be made (ValueError naming every bad
    field)."""
    n_experts: int
    top_k: int
    moe_ffn: int
    moe_every: int = 1
    first_dense: int = 0
    score: str = "softmax"        # softmax then top-k (Mixtral, Qwen); sigmoid then top-k (DeepSeek-V3)
    norm_topk: bool = True        # the k chosen weights renormalised to sum to 1
    routed_scale: float = 1.0     # the routed experts' weights times this (DeepSeek's routed_scaling_factor)
    n_shared: int = 0
    shared_ffn: int = 0
    shared_gate: bool = False
    aux_coeff: float = 0.0        # load-balancing loss, per sequence (see raytp.models.moe.routing)
    z_coeff: float = 0.0          # router z-loss
    capacity_factor: float | None = None  # None: dropless; else each expert takes ceil(T k / E * cf) per sequence
    bias_rate: float = 0.0        # DeepSeek-V3's loss-free balancing: a per-expert bias for the choice only

    def __post_init__(self):
        problems = []
        ints = ("n_experts", "top_k", "moe_ffn", "moe_every", "first_dense", "n_shared", "shared_ffn")
        for name in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                problems.append(f"{name}: expected an integer, got {v!r}")
        for name in ("routed_scale", "aux_coeff", "z_coeff", "bias_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                problems.append(f"{name}: expected a number, got {v!r}")
            else:
                object.__setattr__(self, name, float(v))
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            problems.append(f"capacity_factor: {cf!r} must be a number > 0, or null (dropless)")
        elif cf is not None:
            object.__setattr__(self, "capacity_factor", float(cf))
        for name in ("norm_topk", "shared_gate"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if problems:
            raise ValueError("; ".join(problems))
        for name in ("n_experts", "moe_ffn", "moe_every"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: {getattr(self, name)} must be >= 1")
        for name in ("first_dense", "n_shared", "shared_ffn", "aux_coeff", "z_coeff", "bias_rate"):
            if getattr(self, name) < 0:
                problems.append(f"{name}: {getattr(self, name)} must be >= 0")
        if not 1 <= self.top_k <= max(self.n_experts, 1):
            problems.append(f"top_k: {self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.score not in SCORES:
            problems.append(f"score: {self.score!r} is not valid; valid: {', '.join(SCORES)}")
        if not self.routed_scale > 0:
            problems.append(f"routed_scale: {self.routed_scale:g} must be > 0")
        if self.n_shared and not self.shared_ffn:
            problems.append(f"shared_ffn: 0 with n_shared={self.n_shared}; give the shared experts' width")
        if self.bias_rate and self.score != "sigmoid":
            problems.append(f"bias_rate: {self.bias_rate:g} with score {self.score!r}; the selection bias is the "
                            "sigmoid router's (DeepSeek-V3)")
        if self.shared_gate and not self.n_shared:
            problems.append("shared_gate: true without shared experts (n_shared: 0)")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def parse(cls, value: Any) -> MoeArgs:
        """One from a mapping of its fields (a job file's, a manifest's); ValueError naming what is unknown,
        missing or invalid."""
        if isinstance(value, cls):
            return value
        names = [f.name for f in fields(cls)]
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping of {', '.join(names)}, got {value!r}")
        problems = [f"unknown field {k!r}; valid: {', '.join(names)}" for k in value if k not in names]
        missing = [n for n in ("n_experts", "top_k", "moe_ffn") if n not in value]
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**value)

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) is an MoE layer."""
        return layer >= self.first_dense and (layer + 1) % self.moe_every == 0

    @property
    def shared_width(self) -> int:
        return self.n_shared * self.shared_ffn
