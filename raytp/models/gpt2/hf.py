"""The Hugging Face spelling of raytp's GPT-2: GPT2LMHeadModel's config.json and weight names.

raytp's GPT is GPT-2, with two differences of spelling: Hugging Face's GPT-2
keeps its projections as Conv1D, whose weight is the transpose of an
nn.Linear's, and prefixes the trunk with ``transformer.``. raytp.models.hf
reads and writes the directories (slice by slice); this file says what differs.
"""
from __future__ import annotations

from raytp.models.args import ModelArgs

MODEL_TYPES = ("gpt2",)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_config(cfg: ModelArgs) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02, "tie_word_embeddings": True,
        "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1,
    }


def config_from_hf(d: dict, where: str = "config.json") -> ModelArgs:
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
    return ModelArgs(n_layer=d["n_layer"], n_head=d["n_head"], n_embd=d["n_embd"], block_size=d["n_positions"],
                     vocab_size=d["vocab_size"], dropout=float(d.get("resid_pdrop", 0.0)))


def to_hf(name: str, cfg: ModelArgs) -> tuple[str, bool]:
    """The directory's name of raytp weight `name`, and whether it is stored transposed (Conv1D)."""
    return f"transformer.{name}", name.endswith(CONV1D)


def from_hf(hf_name: str, cfg: ModelArgs) -> str | None:
    """raytp's name of a directory's weight; None for what raytp does not keep."""
    if hf_name.startswith("lm_head.") or hf_name.endswith((".attn.bias", ".attn.masked_bias")):
        return None  # the tied head, and causal-mask buffers of older transformers
    return hf_name.removeprefix("transformer.")


def from_hf_state(hf_state: dict) -> dict:
    """A whole GPT2LMHeadModel state (a pytorch_model.bin) in raytp's names and layouts."""
    out = {}
    for k, v in hf_state.items():
        name = from_hf(k, None)
        if name is not None:
            out[name] = v.t().contiguous() if name.endswith(CONV1D) else v
    return out
