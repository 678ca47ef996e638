"""Qwen3's and Qwen3-MoE's Hugging Face spelling (Qwen3ForCausalLM, Qwen3MoeForCausalLM): a Llama whose
attention normalises each query and key head (``q_norm``, ``k_norm``: raytp's ``qk_norm``) and whose head
width is its own (``head_dim``, which may differ from hidden_size / num_attention_heads); Qwen3-MoE's MLPs
are expert layers (softmax router, top k renormalised when ``norm_topk_prob``; ``mlp_only_layers`` dense,
the rest MoE every ``decoder_sparse_step``). Its weight names are raytp's own (``mlp.gate``,
``mlp.experts.<j>.gate_proj``, ``self_attn.q_norm``), as transformers writes them on disk.
"""
from __future__ import annotations

from raytp.models.args import ModelArgs
from raytp.models.moe.args import MoeArgs

MODEL_TYPES = ("qwen3", "qwen3_moe")


def fields_from_hf(d: dict, problems: list[str]) -> dict:
    """ModelArgs fields a Qwen3 config.json sets beyond a Llama's; what raytp cannot be joins `problems`."""
    if d.get("use_sliding_window"):
        problems.append("use_sliding_window is true; raytp attends over the whole context")
    out = {"qk_norm": True, "head_dim": d.get("head_dim")}
    n_experts = d.get("num_experts") or d.get("num_local_experts")  # transformers 5 writes the second
    if d.get("model_type") != "qwen3_moe" or not n_experts:
        return out
    dense = sorted(d.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        problems.append(f"mlp_only_layers={dense}: raytp keeps the first layers dense only (first_dense)")
    try:
        out["moe"] = MoeArgs(n_experts=n_experts, top_k=d["num_experts_per_tok"],
                             moe_ffn=d["moe_intermediate_size"], moe_every=d.get("decoder_sparse_step", 1),
                             first_dense=len(dense), norm_topk=bool(d.get("norm_topk_prob", False)))
    except (KeyError, ValueError) as e:
        problems.append(f"num_experts / num_experts_per_tok / moe_intermediate_size: {e}")
    return out


def why_not(cfg: ModelArgs) -> str | None:
    """Why a model with expert layers cannot be written as a Qwen3-MoE (None: it can)."""
    m = cfg.moe
    differs = [f"{k}={getattr(m, k)!r}" for k, want in (("score", "softmax"), ("routed_scale", 1.0), ("n_shared", 0))
               if getattr(m, k) != want]
    return (f"its expert layers are not Qwen3-MoE's ({', '.join(differs)}); the Hugging Face export writes "
            "softmax routers without shared experts") if differs else None


def hf_config(llama: dict, cfg: ModelArgs) -> dict:
    """A Llama's config.json made a Qwen3's (or, with expert layers, a Qwen3-MoE's); ValueError when it
    cannot be one."""
    out = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp")}
    out.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": cfg.head_width,
                "attention_bias": False, "use_sliding_window": False, "sliding_window": None})
    if cfg.moe is None:
        return out
    why = why_not(cfg)
    if why:
        raise ValueError(f"export: {why}")
    m = cfg.moe
    out.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": m.n_experts,
                "num_local_experts": m.n_experts,
                "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.moe_ffn,
                "decoder_sparse_step": m.moe_every, "mlp_only_layers": list(range(m.first_dense)),
                "norm_topk_prob": m.norm_topk, "output_router_logits": False,
                "router_aux_loss_coef": m.aux_coeff / m.top_k})
    return out
