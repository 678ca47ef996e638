"""The Hugging Face bridge: raytp's GPT <-> a GPT-2 model directory.

raytp's GPT is GPT-2, with two differences of spelling: Hugging Face's GPT-2
keeps its projections as Conv1D, whose weight is the transpose of an
nn.Linear's, and prefixes the trunk with ``transformer.``. A directory written
here (config.json + model.safetensors) loads with
``GPT2LMHeadModel.from_pretrained(DIR)`` and no raytp installed; one written
by transformers loads into raytp (``model.init_from: DIR``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from raytp.model import GPTConfig

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_config(cfg: GPTConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02, "tie_word_embeddings": True,
        "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1,
    }


def config_from_hf(d: dict, where: str = "config.json") -> GPTConfig:
    problems = []
    if d.get("model_type") not in (None, "gpt2"):
        problems.append(f"model_type is {d.get('model_type')!r}, only 'gpt2' is supported")
    if d.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function {d['activation_function']!r}; raytp's GPT uses tanh GELU")
    if d.get("n_inner") not in (None, 4 * d.get("n_embd", 0)):
        problems.append(f"n_inner={d['n_inner']}; raytp's MLP is 4*n_embd wide")
    if d.get("tie_word_embeddings") is False:
        problems.append("untied LM head; raytp ties it to the token embedding")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    return GPTConfig(n_layer=d["n_layer"], n_head=d["n_head"], n_embd=d["n_embd"], block_size=d["n_positions"],
                     vocab_size=d["vocab_size"], dropout=float(d.get("resid_pdrop", 0.0)))


def to_hf_state(model_state: dict) -> dict:
    """raytp names and Linear layout -> transformers' GPT2LMHeadModel state."""
    out = {}
    for k, v in model_state.items():
        if k == "lm_head.weight":
            continue  # tied to wte
        if k.endswith(CONV1D):
            v = v.t()
        out[f"transformer.{k}"] = v.contiguous()
    return out


def from_hf_state(hf_state: dict) -> dict:
    out = {}
    for k, v in hf_state.items():
        if k.startswith("lm_head.") or k.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the tied head, and causal-mask buffers of older transformers
        k = k.removeprefix("transformer.")
        out[k] = v.t().contiguous() if k.endswith(CONV1D) else v
    return out


def save_hf(model_state: dict, cfg: GPTConfig, out_dir: Path) -> None:
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    save_file(to_hf_state(model_state), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def load_hf(model_dir: Path) -> tuple[GPTConfig, dict]:
    """(config, raytp model state) of a GPT-2 directory (safetensors, or pytorch_model.bin read weights-only)."""
    model_dir = Path(model_dir)
    cfg_file = model_dir / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"model.init_from: {model_dir} has no config.json (expected a GPT-2 model directory)")
    cfg = config_from_hf(json.loads(cfg_file.read_text()), str(cfg_file))
    if (model_dir / "model.safetensors").exists():
        from safetensors.torch import load_file
        hf_state = load_file(str(model_dir / "model.safetensors"))
    elif (model_dir / "pytorch_model.bin").exists():
        hf_state = torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"model.init_from: {model_dir} has neither model.safetensors nor pytorch_model.bin")
    state = from_hf_state(hf_state)
    from raytp.model import GPT
    with torch.device("meta"):  # names only, no memory
        expected = {k for k in GPT(cfg).state_dict() if k != "lm_head.weight"}
    if set(state) != expected:
        raise ValueError(f"model.init_from: {model_dir}: weights do not match GPT-2 of config.json: missing "
                         f"{sorted(expected - set(state))[:5]}, unexpected {sorted(set(state) - expected)[:5]}")
    return cfg, {k: v.float() for k, v in state.items()}
