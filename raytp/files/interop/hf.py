"""The Hugging Face bridge: raytp's models <-> Hugging Face model directories, for every architecture.

Each architecture's spelling (config.json, weight names, transposed layouts)
is its spec's ``hf`` adapter (raytp.models.<arch>.hf). The weights written here
(one model.safetensors, or shards with their index as transformers names them,
fp32 or bf16) with config_json's config.json load with transformers'
``from_pretrained`` and no raytp installed (raytp.files.interop.export.write_hf writes
the whole directory); one written by transformers (one safetensors file, or
several with their index) loads into raytp (``model.init_from: DIR``), each
rank reading only the byte ranges of its slices.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from raytp.models.args import ModelArgs
from raytp.models.registry import build_model, spec, spec_for_hf, split_of
from raytp.parallel.sharding import shard_ranges
from raytp.parallel.zero_plan import consecutive
from raytp import trust
from raytp.files.safetensors_io import FormatError, Reader, write
from raytp.files.storage import Storage

def config_of(d: dict, where: str = "config.json") -> ModelArgs:
    """The model shape of a config.json, by the architecture its model_type names."""
    return spec_for_hf(d, where).hf.config_from_hf(d, where)


def to_hf(name: str, cfg: ModelArgs) -> tuple[str, bool]:
    """The directory's name of raytp weight `name`, and whether it is stored transposed (GPT-2's Conv1D)."""
    return spec(cfg).hf.to_hf(name, cfg)


def from_hf_name(hf_name: str, cfg: ModelArgs) -> str | None:
    """raytp's name of a directory's weight; None for what raytp does not keep."""
    return spec(cfg).hf.from_hf(hf_name, cfg)


def _tensors_of(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name -> (file, shape) from the safetensors headers (a single file, or a sharded one with its
    index); {} when the directory holds only a pytorch_model.bin."""
    storage = Storage(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"model.init_from: {index}: has no weight_map of tensor names to files")
        files = []
        for f in weight_map.values():
            if f not in files:  # a name of a file in the directory, never a path out of it
                trust.inside(model_dir, trust.plain_name(f, f"model.init_from: {index}: weight_map"), "weight_map")
                files.append(f)
        files.sort()
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


def _json(path: Path) -> dict:
    """A JSON object file of a Hugging Face directory (at most 64 MiB); ValueError naming it."""
    try:
        if path.stat().st_size > 64 << 20:
            raise ValueError("over 64 MiB")
        d = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"model.init_from: {path}: not a JSON file raytp reads ({str(e)[:200]})") from None
    if not isinstance(d, dict):
        raise ValueError(f"model.init_from: {path}: not a JSON object")
    return d


def inspect(model_dir: Path) -> ModelArgs:
    """The model shape of a Hugging Face directory of an architecture raytp knows, its weights checked by
    name and shape (headers only)."""
    model_dir = Path(model_dir)
    cfg_file = model_dir / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"model.init_from: {model_dir} has no config.json (expected a Hugging Face GPT-2 or "
                         "Llama model directory)")
    cfg = config_of(_json(cfg_file), str(cfg_file))
    trust.check_model_size(cfg, f"model.init_from: {cfg_file}")  # before a model is built to compare with
    found = _tensors_of(model_dir)
    if not found:
        reads_bin = spec(cfg).hf.bin_state is not None
        if not reads_bin or not (model_dir / "pytorch_model.bin").exists():
            raise ValueError(f"model.init_from: {model_dir} has no model.safetensors"
                             + (" nor pytorch_model.bin" if reads_bin else ""))
        return cfg
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
    """Give a shard (built empty) its slices of a Hugging Face directory's weights, reading only those."""
    model_dir = Path(model_dir)
    found = _tensors_of(model_dir)
    if not found:  # pytorch_model.bin: a pickle, read whole (weights_only)
        from raytp.train.shard_state import slice_state
        bin_state = torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
        full = spec(model.cfg).hf.bin_state(bin_state)
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
            if file not in readers:
                readers[file] = Reader(storage, file, storage.size(file))
            reader = readers[file]
            s = split_of(name, model.cfg)
            if s.dim is None or tp == 1 or getattr(p, "whole_on_rank", False):  # whole: an expert at etp 1
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


DEFAULT_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # config.json's torch_dtype


def parse_size(text: str | int) -> int:
    """Bytes of a size as transformers spells it: "5GB" (10^9), "500MiB" (2^20), "100KB", or a number of
    bytes; ValueError naming what is valid."""
    if isinstance(text, int):
        n = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
        if not m:
            raise ValueError(f"--max-shard-size: {text!r} is not a size (e.g. 5GB, 500MB, 1GiB, or bytes)")
        n = int(float(m.group(1)) * UNITS[(m.group(2) or "B").upper()])
    if n <= 0:
        raise ValueError(f"--max-shard-size: {text!r} must be more than 0 bytes")
    return n


def plan_shards(sizes: list[int], limit: int) -> list[list[int]]:
    """Tensors (their sizes in bytes, in order) grouped in order into files of at most `limit` bytes; a
    tensor larger than the limit gets a file of its own (as transformers' save_pretrained does)."""
    return consecutive(sizes, limit)


def shard_names(count: int) -> list[str]:
    """transformers' names: model.safetensors alone, else model-00001-of-0000N.safetensors."""
    if count <= 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def config_json(cfg: ModelArgs, dtype: torch.dtype, special_ids: dict) -> dict:
    """The config.json of a model of `cfg` exported in `dtype`: its architecture's, with the tokenizer's
    special token ids (`special_ids`: bos/eos/pad_token_id) where known; unknown bos/eos are null rather
    than transformers' defaults (a Llama's 1 and 2 would be ordinary tokens), unless the architecture
    names its own (GPT-2: the last id, its <|endoftext|>)."""
    config = spec(cfg).hf.config_to_hf(cfg)
    for key in ("bos_token_id", "eos_token_id"):
        config[key] = special_ids.get(key, config.get(key))
    if special_ids.get("pad_token_id") is not None:
        config["pad_token_id"] = special_ids["pad_token_id"]
    config["torch_dtype"] = DTYPE_NAMES[dtype]
    return config


def save_weights(ckpt, out_dir: Path, dtype: torch.dtype = torch.float32,
                 max_shard_size: str | int = DEFAULT_SHARD_SIZE) -> list[str]:
    """Write a checkpoint's weights in `dtype` into `out_dir` as its architecture's Hugging Face names:
    one model.safetensors, or files of at most `max_shard_size` with model.safetensors.index.json
    (written last). Tensor by tensor: one whole tensor in memory at a time, in the checkpoint's dtype
    and in `dtype` (export.unmap_large_frees keeps freed ones from piling up). The files written."""
    out_dir = Path(out_dir)
    cfg = ModelArgs(**ckpt.manifest["model"])
    items = []
    for key in ckpt.keys():
        if not key.startswith("model/"):
            continue
        name = key.removeprefix("model/")
        entry = ckpt.manifest.get("tensors", {}).get(key)
        shape = tuple(entry["shape"]) if entry and "shape" in entry else tuple(ckpt.read(key, 0, 1).shape)
        hf_name, conv = to_hf(name, cfg)

        def produce(key=key, conv=conv):
            entry = ckpt.manifest.get("tensors", {}).get(key, {})
            if conv and entry.get("transposed"):  # stored (in, out): already the Conv1D layout
                return ckpt.read(key, 0, 1, stored=True).to(dtype)
            t = ckpt.read(key, 0, 1).to(dtype)
            if not conv:
                return t
            return (t[:, i:i + 64].t() for i in range(0, t.shape[1], 64))  # the transpose, 64 rows at a time
        items.append((hf_name, dtype, shape[::-1] if conv else shape, produce))
    sizes = [math.prod(shape) * dtype.itemsize for _, _, shape, _ in items]
    shards = plan_shards(sizes, parse_size(max_shard_size))
    names = shard_names(len(shards))
    for file, members in zip(names, shards):
        with open(out_dir / file, "wb") as f:
            write(f, [items[i] for i in members], {"format": "pt"})
    if len(names) == 1:
        return names
    weight_map = {items[i][0]: file for file, members in zip(names, shards) for i in members}
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [*names, "model.safetensors.index.json"]
