"""Qwen2's and Qwen2-MoE's Hugging Face spelling (Qwen2ForCausalLM, Qwen2MoeForCausalLM; Qwen1.5 and Qwen2.5
write the same): a Llama with biases on its query, key and value projections (raytp's ``qkv_bias``); Qwen2-MoE's
MLPs are expert layers (softmax router, top k, renormalised only with ``norm_topk_prob``), each with one shared
expert of its own width behind a sigmoid gate (``shared_expert``, ``shared_expert_gate``), the
``mlp_only_layers`` dense and the rest MoE every ``decoder_sparse_step``. Its weight names are raytp's own
(``self_attn.q_proj.bias``, ``mlp.gate``, ``mlp.experts.<j>.gate_proj``, ``mlp.shared_expert.up_proj``), as
transformers writes them on disk.
"""
from __future__ import annotations

from raytp.models.args import ModelArgs
from raytp.models.moe.args import MoeArgs

MODEL_TYPES = ("qwen2", "qwen2_moe")


def fields_from_hf(d: dict, problems: list[str]) -> dict:
    """ModelArgs fields a Qwen2 config.json sets beyond a Llama's; what raytp cannot be joins `problems`."""
    if d.get("use_sliding_window"):
        problems.append("use_sliding_window is true; raytp attends over the whole context")
    out = {"qkv_bias": bool(d.get("qkv_bias", True))}  # Qwen2 always has them; Qwen2-MoE says so
    if d.get("model_type") != "qwen2_moe":
        return out
    dense = sorted(d.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        problems.append(f"mlp_only_layers={dense}: raytp keeps the first layers dense only (first_dense)")
    shared = d.get("shared_expert_intermediate_size") or 0
    try:
        out["moe"] = MoeArgs(n_experts=d["num_experts"], top_k=d["num_experts_per_tok"],
                             moe_ffn=d["moe_intermediate_size"], moe_every=d.get("decoder_sparse_step", 1),
                             first_dense=len(dense), norm_topk=bool(d.get("norm_topk_prob", False)),
                             n_shared=1 if shared else 0, shared_ffn=shared, shared_gate=bool(shared))
    except (KeyError, ValueError) as e:
        problems.append(f"num_experts / num_experts_per_tok / moe_intermediate_size: {e}")
    return out


def why_not(cfg: ModelArgs) -> str | None:
    """Why a model cannot be written as a Qwen2 or Qwen2-MoE (None: it can)."""
    if cfg.qk_norm:
        return "q/k head norms (qk_norm) with q/k/v biases: neither a Qwen2 nor a Qwen3"
    if cfg.head_width != cfg.n_embd // cfg.n_head:
        return f"head_dim={cfg.head_width}: a Qwen2's heads are hidden_size / num_attention_heads wide"
    m = cfg.moe
    if m is None:
        return None
    differs = [f"{k}={getattr(m, k)!r}" for k, want in (("score", "softmax"), ("routed_scale", 1.0), ("n_shared", 1),
                                                          ("shared_gate", True)) if getattr(m, k) != want]
    return (f"its expert layers are not Qwen2-MoE's ({', '.join(differs)}); a Qwen2-MoE layer has a softmax "
            "router and one gated shared expert") if differs else None


def hf_config(llama: dict, cfg: ModelArgs) -> dict:
    """A Llama's config.json made a Qwen2's (or, with expert layers, a Qwen2-MoE's); ValueError when it cannot
    be one."""
    why = why_not(cfg)
    if why:
        raise ValueError(f"export: {why}")
    out = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp", "attention_bias", "head_dim")}
    out.update({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "qkv_bias": True,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer})
    if cfg.moe is None:
        return out
    m = cfg.moe
    out.update({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": m.n_experts,
                "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.moe_ffn,
                "shared_expert_intermediate_size": m.shared_width, "decoder_sparse_step": m.moe_every,
                "mlp_only_layers": list(range(m.first_dense)), "norm_topk_prob": m.norm_topk,
                "output_router_logits": False, "router_aux_loss_coef": m.aux_coeff / m.top_k})
    return out
