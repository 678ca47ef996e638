"""Mixtral's Hugging Face spelling (MixtralForCausalLM): a Llama whose every MLP is an MoE layer of SwiGLU
experts, a softmax router choosing top k renormalised, no shared experts.

On disk (the Hub's files, and what transformers 4.x and 5.x write with save_pretrained) each expert is three
weights, ``model.layers.<i>.block_sparse_moe.experts.<j>.w1/w3/w2.weight`` (gate, up, down), and the router is
``block_sparse_moe.gate.weight``; transformers 5 fuses the experts in memory (``mlp.experts.gate_up_proj``)
and converts when it loads and saves, so raytp reads and writes the per-expert names only. raytp's own names
are those of its MoE layer (raytp.models.moe.layer: ``layers.<i>.mlp.experts.<j>.gate_proj.weight``, ...).
"""
from __future__ import annotations

import re

from raytp.models.args import ModelArgs
from raytp.models.moe.args import MoeArgs

MODEL_TYPE = "mixtral"
LEAVES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # raytp's expert leaf -> Mixtral's
_OURS = re.compile(r"layers\.(\d+)\.mlp\.(gate\.weight|experts\.(\d+)\.(gate|up|down)_proj\.weight)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(gate\.weight|experts\.(\d+)\.(w[123])\.weight)")


def moe_from_hf(d: dict, problems: list[str]) -> MoeArgs | None:
    """The expert layers of a Mixtral config.json; what raytp's router cannot be is added to `problems`."""
    if d.get("router_jitter_noise"):
        problems.append(f"router_jitter_noise={d['router_jitter_noise']}; raytp's router adds no noise")
    try:
        return MoeArgs(n_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"], moe_ffn=d["intermediate_size"])
    except (KeyError, ValueError) as e:
        problems.append(f"num_local_experts / num_experts_per_tok: {e}")
        return None


def why_not(cfg: ModelArgs) -> str | None:
    """Why a model's expert layers cannot be written as a Mixtral (None: they can)."""
    m = cfg.moe
    differs = [f"{k}={getattr(m, k)!r}" for k, want in (("score", "softmax"), ("norm_topk", True),
                                                          ("routed_scale", 1.0), ("n_shared", 0),
                                                          ("moe_every", 1), ("first_dense", 0))
               if getattr(m, k) != want]
    if not differs:
        return None
    return (f"its expert layers are not Mixtral's ({', '.join(differs)}); the Hugging Face export writes "
            "Mixtral-shaped MoE models (softmax router, top k renormalised, every layer MoE, no shared experts)")


def hf_config(llama: dict, cfg: ModelArgs) -> dict:
    """A Llama's config.json made a Mixtral's; ValueError when the model is not Mixtral-shaped."""
    why = why_not(cfg)
    if why:
        raise ValueError(f"export: {why}")
    out = {k: v for k, v in llama.items() if k not in ("mlp_bias", "attention_bias")}
    out.update({"architectures": ["MixtralForCausalLM"], "model_type": MODEL_TYPE,
                "intermediate_size": cfg.moe.moe_ffn, "num_local_experts": cfg.moe.n_experts,
                "num_experts_per_tok": cfg.moe.top_k, "router_jitter_noise": 0.0, "sliding_window": None,
                "output_router_logits": False, "router_aux_loss_coef": cfg.moe.aux_coeff / cfg.moe.top_k})
    return out


def to_hf(name: str) -> str | None:
    """Mixtral's name of an expert layer's weight; None for any other weight (the Llama's name holds)."""
    m = _OURS.fullmatch(name)
    if m is None:
        return None
    layer, what, expert, leaf = m.groups()
    if expert is None:
        return f"model.layers.{layer}.block_sparse_moe.gate.weight"
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{LEAVES[leaf + '_proj']}.weight"


def from_hf(hf_name: str) -> str | None:
    """raytp's name of a Mixtral expert layer's weight; None for any other."""
    m = _THEIRS.fullmatch(hf_name)
    if m is None:
        return None
    layer, what, expert, leaf = m.groups()
    if expert is None:
        return f"layers.{layer}.mlp.gate.weight"
    ours = {v: k for k, v in LEAVES.items()}[leaf]
    return f"layers.{layer}.mlp.experts.{expert}.{ours}.weight"
