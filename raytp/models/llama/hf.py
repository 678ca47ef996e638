"""The Hugging Face spelling of raytp's Llama: LlamaForCausalLM's config.json and weight names.

raytp's Llama names its weights as transformers' LlamaForCausalLM does, minus
the trunk's ``model.`` prefix; the layouts are the same (nn.Linear), so only
names and the config move (Llama 3.1+'s rotary rescaling included: rope_scaling
with rope_type llama3, any other refused). raytp.files.interop.hf reads and writes the
directories (slice by slice) for both architectures; this file says what differs.
"""
from __future__ import annotations

import dataclasses

from raytp.models.args import ModelArgs, RopeScaling
from raytp.models.llama import mixtral, qwen2, qwen3

# Mistral is a Llama with (optionally) sliding-window attention; Mixtral a Mistral of expert layers (mixtral.py);
# Qwen3 a Llama with per-head q/k norms and its own head width, Qwen3-MoE with expert layers (qwen3.py); Qwen2
# one with q/k/v biases, Qwen2-MoE with expert layers and a gated shared expert each (qwen2.py)
MODEL_TYPES = ("llama", "mistral", mixtral.MODEL_TYPE, *qwen3.MODEL_TYPES, *qwen2.MODEL_TYPES)


def spelled_as_llama_names(cfg: ModelArgs | None) -> bool:
    """Whether the directory names its weights as raytp does (all but Mixtral's expert layers)."""
    return cfg is None or cfg.moe is None or cfg.qk_norm or cfg.qkv_bias


def hf_config(cfg: ModelArgs) -> dict:
    """A LlamaForCausalLM's config.json, or with expert layers a MixtralForCausalLM's."""
    # transformers >= 5 reads rope_parameters, older releases rope_theta and rope_scaling: both are written
    scaling = dataclasses.asdict(cfg.rope_scaling) if cfg.rope_scaling else None
    llama = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_width,
        "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": 0.02,
        "torch_dtype": "float32",
    }
    if cfg.qkv_bias:
        return qwen2.hf_config(llama, cfg)
    if cfg.qk_norm:
        return qwen3.hf_config(llama, cfg)
    return llama if cfg.moe is None else mixtral.hf_config(llama, cfg)


def rope_scaling_of(d: dict) -> RopeScaling | None:
    """The rotary rescaling a config.json asks for (transformers >= 5 spells it rope_parameters, older
    releases rope_scaling, some ``type`` for ``rope_type``); None: unscaled. ValueError naming the key and
    what raytp cannot do (any rope_type but llama3, a missing or invalid field)."""
    for key in ("rope_parameters", "rope_scaling"):
        r = d.get(key) or {}
        kind = r.get("rope_type", r.get("type", "default"))
        if kind == "default":
            continue
        given = {f.name: r[f.name] for f in dataclasses.fields(RopeScaling) if f.name in r}
        try:
            return RopeScaling.parse({**given, "rope_type": kind})
        except ValueError as e:
            raise ValueError(f"{key} {r!r}: {e}") from None
    return None


def config_from_hf(d: dict, where: str = "config.json") -> ModelArgs:
    """The shape of a LlamaForCausalLM (or Mistral, Mixtral, Qwen3, Qwen3-MoE) config.json; what raytp's Llama
    cannot be is refused, every such key named at once."""
    problems = []
    if d.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {d['hidden_act']!r}; raytp's Llama uses silu (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            problems.append(f"{key} is true; raytp's Llama has no biases")
    try:
        scaling = rope_scaling_of(d)
    except ValueError as e:
        scaling = None
        problems.append(str(e))
    theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    heads, width = d["num_attention_heads"], d["hidden_size"]
    extra = qwen3.fields_from_hf(d, problems) if d.get("model_type") in qwen3.MODEL_TYPES else \
        qwen2.fields_from_hf(d, problems) if d.get("model_type") in qwen2.MODEL_TYPES else {}
    if d.get("head_dim") not in (None, width // heads) and not extra.get("qk_norm"):
        problems.append(f"head_dim={d['head_dim']} differs from hidden_size/num_attention_heads={width // heads}")
    window = d.get("sliding_window")
    if d.get("model_type") == mixtral.MODEL_TYPE:
        extra["moe"] = mixtral.moe_from_hf(d, problems)
    windowed = d.get("model_type") in ("mistral", mixtral.MODEL_TYPE)
    if windowed and window is not None and window < d.get("max_position_embeddings", 0):
        problems.append(f"sliding_window={window} attention; raytp attends over the whole context")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    return ModelArgs(arch="llama", n_layer=d["num_hidden_layers"], n_head=heads, n_embd=width,
                     n_kv_head=d.get("num_key_value_heads") or heads, intermediate_size=d["intermediate_size"],
                     block_size=d["max_position_embeddings"], vocab_size=d["vocab_size"],
                     rope_theta=float(theta), norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                     tie_embeddings=bool(d.get("tie_word_embeddings", False)), rope_scaling=scaling, **extra)


def to_hf(name: str, cfg: ModelArgs | None = None) -> tuple[str, bool]:
    """The directory's name of raytp weight `name`; never transposed (both are nn.Linear)."""
    theirs = None if spelled_as_llama_names(cfg) else mixtral.to_hf(name)
    if theirs is not None:
        return theirs, False
    return (name if name.startswith("lm_head.") else f"model.{name}"), False


def from_hf(hf_name: str, cfg: ModelArgs) -> str | None:
    """raytp's name of a weight in the directory, or None for what raytp does not keep (the tied head,
    rotary frequency buffers older transformers saved)."""
    if hf_name.endswith("rotary_emb.inv_freq") or (cfg.tied and hf_name == "lm_head.weight"):
        return None
    ours = None if spelled_as_llama_names(cfg) else mixtral.from_hf(hf_name)
    return ours or hf_name.removeprefix("model.")


def block_size(job: int, model: int) -> int:
    """A Llama trains at the job's context length, up to the model's max_position_embeddings."""
    if job > model:
        raise ValueError(f"model.block_size: {job} exceeds the max_position_embeddings={model} of the model")
    return job
