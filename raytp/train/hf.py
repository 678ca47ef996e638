"""The Hugging Face bridge: raytp's models <-> Hugging Face model directories (GPT-2 and Llama).

raytp's GPT is GPT-2, with two differences of spelling: Hugging Face's GPT-2
keeps its projections as Conv1D, whose weight is the transpose of an
nn.Linear's, and prefixes the trunk with ``transformer.``. raytp's Llama is
LlamaForCausalLM with the trunk's ``model.`` prefix dropped
(raytp.train.hf_llama). A directory written here (config.json +
model.safetensors) loads with ``GPT2LMHeadModel`` / ``LlamaForCausalLM``
``.from_pretrained(DIR)`` and no raytp installed; one written by transformers
(one safetensors file, or several with their index) loads into raytp
(``model.init_from: DIR``), each rank reading only the byte ranges of its slices.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from raytp.model import GPTConfig
from raytp.train.storage import Storage

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


def _is_llama(d: dict) -> bool:
    from raytp.train.hf_llama import MODEL_TYPES
    return d.get("model_type") in MODEL_TYPES


def _config(d: dict, where: str) -> GPTConfig:
    if _is_llama(d):
        from raytp.train import hf_llama
        return hf_llama.config_from_hf(d, where)
    return config_from_hf(d, where)


def to_hf(name: str, cfg: GPTConfig) -> tuple[str, bool]:
    """The directory's name of raytp weight `name`, and whether it is stored transposed (GPT-2's Conv1D)."""
    if cfg.arch == "llama":
        from raytp.train.hf_llama import to_hf as llama_name
        return llama_name(name), False
    return f"transformer.{name}", name.endswith(CONV1D)


def from_hf_name(hf_name: str, cfg: GPTConfig) -> str | None:
    """raytp's name of a directory's weight; None for what raytp does not keep."""
    if cfg.arch == "llama":
        from raytp.train.hf_llama import from_hf
        return from_hf(hf_name, cfg)
    if hf_name.startswith("lm_head.") or hf_name.endswith((".attn.bias", ".attn.masked_bias")):
        return None  # the tied head, and causal-mask buffers of older transformers
    return hf_name.removeprefix("transformer.")


def from_hf_state(hf_state: dict) -> dict:
    out = {}
    for k, v in hf_state.items():
        if k.startswith("lm_head.") or k.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the tied head, and causal-mask buffers of older transformers
        k = k.removeprefix("transformer.")
        out[k] = v.t().contiguous() if k.endswith(CONV1D) else v
    return out


def _tensors_of(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name -> (file, shape) from the safetensors headers (a single file, or a sharded one with its
    index); {} when the directory holds only a pytorch_model.bin."""
    from raytp.train.safetensors_io import FormatError, Reader
    storage = Storage(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        return {}
    out = {}
    for f in files:
        try:
            r = Reader(storage, f, storage.size(f))
        except (FormatError, OSError) as e:
            raise ValueError(f"model.init_from: {model_dir / f}: cannot be read ({e})") from None
        out.update({name: (f, tuple(v["shape"])) for name, v in r.tensors.items()})
    return out


def inspect(model_dir: Path) -> GPTConfig:
    """The model shape of a GPT-2 or Llama directory, its weights checked by name and shape (headers only)."""
    model_dir = Path(model_dir)
    cfg_file = model_dir / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"model.init_from: {model_dir} has no config.json (expected a Hugging Face GPT-2 or "
                         "Llama model directory)")
    cfg = _config(json.loads(cfg_file.read_text()), str(cfg_file))
    found = _tensors_of(model_dir)
    if not found:
        if cfg.arch != "gpt2" or not (model_dir / "pytorch_model.bin").exists():
            raise ValueError(f"model.init_from: {model_dir} has no model.safetensors"
                             + (" nor pytorch_model.bin" if cfg.arch == "gpt2" else ""))
        return cfg
    from raytp.model import build_model
    with torch.device("meta"):  # names and shapes only, no memory
        expected = {n: tuple(p.shape) for n, p in build_model(cfg).named_parameters()}
    have = {from_hf_name(k, cfg): v[1] for k, v in found.items()}
    have.pop(None, None)
    wrong = [n for n in expected if n in have and have[n] != (expected[n][::-1] if to_hf(n, cfg)[1] else expected[n])]
    if set(have) != set(expected) or wrong:
        raise ValueError(f"model.init_from: {model_dir}: weights do not match the {cfg.arch} of config.json: missing "
                         f"{sorted(set(expected) - set(have))[:5]}, unexpected {sorted(set(have) - set(expected))[:5]}"
                         + (f", other shapes {wrong[:5]}" if wrong else ""))
    return cfg


def load_into(model_dir, model, rank: int, tp: int) -> None:
    """Give a shard (built empty) its slices of a GPT-2 or Llama directory's weights, reading only those."""
    from raytp.parallel.sharding import shard_ranges, sharding_of
    from raytp.train.safetensors_io import Reader
    model_dir = Path(model_dir)
    found = _tensors_of(model_dir)
    if not found:  # pytorch_model.bin: a pickle, read whole (weights_only)
        from raytp.train.shard_state import slice_state
        full = from_hf_state(torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True))
        part = slice_state({"model": full}, rank, tp)["model"]
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(part[name])
        return
    storage, readers = Storage(model_dir), {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            hf_name, conv = to_hf(name, model.cfg)
            file, shape = found[hf_name]
            reader = readers.setdefault(file, Reader(storage, file))
            s = sharding_of(name, model.cfg)
            if s.dim is None or tp == 1:
                t = reader.rows(hf_name)
                p.copy_(t.t() if conv else t)
                continue
            n, at = (shape[::-1] if conv else shape)[s.dim], 0
            for r in shard_ranges(s, n, rank, tp):
                real = range(r.start, min(r.stop, n))
                if len(real):
                    hf_dim = 1 - s.dim if conv else s.dim  # a Conv1D weight is the transpose of our Linear's
                    if hf_dim == 0:
                        block = reader.rows(hf_name, real.start, len(real))
                    else:
                        block = reader.block(hf_name, range(shape[0]), real)
                    p.narrow(s.dim, at, len(real)).copy_(block.t() if conv else block)
                at += len(r)


def save(ckpt, out_dir: Path) -> None:
    """Write a checkpoint as a GPT-2 or Llama directory, tensor by tensor (one whole tensor in memory at a
    time)."""
    from raytp.train import hf_llama, safetensors_io
    from raytp.train.export import unmap_large_frees
    unmap_large_frees()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = GPTConfig(**ckpt.manifest["model"])
    config = hf_llama.hf_config(cfg) if cfg.arch == "llama" else hf_config(cfg)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    items = []
    for key in ckpt.keys():
        if not key.startswith("model/"):
            continue
        name = key.removeprefix("model/")
        spec = ckpt.manifest["tensors"][key] if "tensors" in ckpt.manifest and key in ckpt.manifest["tensors"] else None
        shape = tuple(spec["shape"]) if spec and "shape" in spec else tuple(ckpt.read(key, 0, 1).shape)
        hf_name, conv = to_hf(name, cfg)

        def produce(key=key, conv=conv):
            spec = ckpt.manifest.get("tensors", {}).get(key, {})
            if conv and spec.get("transposed"):  # stored (in, out): already the Conv1D layout
                return ckpt.read(key, 0, 1, stored=True).float()
            t = ckpt.read(key, 0, 1).float()
            if not conv:
                return t
            return (t[:, i:i + 64].t() for i in range(0, t.shape[1], 64))  # the transpose, 64 rows at a time
        items.append((hf_name, torch.float32, shape[::-1] if conv else shape, produce))
    with open(out_dir / "model.safetensors", "wb") as f:
        safetensors_io.write(f, items, {"format": "pt"})
