"""The architectures raytp trains, by ``model.arch``: the one place that names them all.

Everything else asks here: which class a config builds, how a parameter splits
over TP ranks (the model's own table), which TP degrees a shape allows, which
architecture a Hugging Face directory holds, and the job checks of each.
"""
from __future__ import annotations

import importlib
import math
import re

import torch

from raytp.models.args import ModelArgs
from raytp.models.base import CausalLM
from raytp.models.arch import ARCHES
from raytp.models.spec import KV_HEADS, ModelSpec
from raytp.models.moe.plan import EXPERT_WEIGHT
from raytp.parallel.placements import REPLICATE, Shard, Split, TensorPlacement, dense_weight, expert_placement
from raytp.tp_degrees import kv_fits, tp_degrees

SPECS: dict[str, ModelSpec] = {name: importlib.import_module(f"raytp.models.{name}.spec").SPEC for name in ARCHES}


def spec(arch: str | ModelArgs) -> ModelSpec:
    """The spec of an architecture name, or of a config's `arch`."""
    name = arch.arch if isinstance(arch, ModelArgs) else arch
    if name not in SPECS:
        raise ValueError(f"model.arch: {name!r} is not one of {', '.join(SPECS)}")
    return SPECS[name]


def spec_for_hf(config: dict, where: str) -> ModelSpec:
    """The spec whose Hugging Face model_type a config.json names (GPT-2 when it names none: old files)."""
    model_type = config.get("model_type") or "gpt2"
    for s in SPECS.values():
        if model_type in s.hf.model_types:
            return s
    known = sorted(t for s in SPECS.values() for t in s.hf.model_types)
    raise ValueError(f"{where}: model_type is {model_type!r}; raytp reads {', '.join(known)}")


def model_class(cfg: ModelArgs) -> type[CausalLM]:
    return spec(cfg).model


def build_model(cfg: ModelArgs, seed: int | None = None) -> CausalLM:
    """The one-device model of `cfg`, initialised from `seed` (on the meta device: shapes only)."""
    return model_class(cfg)(cfg, seed)


def split_of(name: str, cfg: ModelArgs | None = None) -> Split:
    """How parameter `name` splits over TP (raytp.parallel.placements: a Shard, or REPLICATE), from its model's
    table (any model's when `cfg` is None: the tables' names do not overlap). The key/value projections of a
    Llama need the `cfg` (their split depends on n_kv_head); asking for them without it is an error, not a
    guess."""
    tables = [spec(cfg)] if cfg is not None else list(SPECS.values())
    for s in tables:
        for pattern, how in s.sharding:
            if re.fullmatch(pattern, name):
                if how is KV_HEADS:
                    if cfg is None:
                        raise ValueError(f"{name}: its sharding depends on n_kv_head; pass the model config")
                    return Shard(0, heads=cfg.kv_heads)
                return how
    return REPLICATE


def is_expert_weight(name: str) -> bool:
    """Whether parameter `name` belongs to one routed expert of an MoE layer (raytp.models.moe)."""
    return EXPERT_WEIGHT.match(name) is not None


UNTRAINED = re.compile(r".*\.expert_bias$")  # a sigmoid router's selection bias: moved by loads, not by AdamW


def bucketed(names, layout=None) -> list[str]:
    """Of parameter `names` (in the model's order), those the optimizer buckets over DP, in order: the trained
    ones, less the routed experts where `layout` gives them a mesh of their own (reduced apart, over expert-DP).
    The distributed optimizer cuts its rows over exactly these (raytp.train.optimizer, raytp.parallel.zero_plan);
    so do checkpoints' tables of its blocks."""
    split = layout is not None and layout.experts_split
    return [n for n in names if not UNTRAINED.match(n) and not (split and is_expert_weight(n))]


def placement_of(name: str, cfg: ModelArgs | None = None, layout=None) -> TensorPlacement:
    """Where parameter `name` lives on the mesh (raytp.parallel.placements): split along TP as its model's
    row says (or replicated there), replicated over DP; a routed expert's, on a `layout` whose experts have a
    mesh of their own (raytp.parallel.layout), split over EP by expert and over ETP as its row says (whole
    when etp is 1), replicated over expert-DP."""
    split = split_of(name, cfg)
    if layout is not None and layout.experts_split and is_expert_weight(name):
        return expert_placement(split if layout.expert_tp > 1 else REPLICATE)
    return dense_weight(split)


def tensor_split(name: str, t: torch.Tensor, cfg: ModelArgs | None = None) -> Split:
    """How tensor `t` of parameter `name` (its weight, or an AdamW state of it) splits: a scalar (AdamW's
    step count) is replicated."""
    return split_of(name, cfg) if t.dim() else REPLICATE


def full_size_of(name: str, cfg: ModelArgs) -> int | None:
    """The unpadded size along the sharded dim, for parameters that are padded."""
    return cfg.vocab_size if split_of(name, cfg).pad else None


def _widths(cfg: ModelArgs) -> list[tuple[str, int]]:
    """The widths TP splits: the dense MLP's and, with expert layers, an expert's and the shared experts'."""
    out = [(spec(cfg).width_name, cfg.mlp_width)]
    if cfg.moe is not None:
        out.append(("moe_ffn", cfg.moe.moe_ffn))
        if cfg.moe.shared_width:
            out.append(("n_shared * shared_ffn", cfg.moe.shared_width))
    return out


def valid_tp_degrees(cfg: ModelArgs) -> list[int]:
    return tp_degrees(cfg.n_head, cfg.kv_heads, math.gcd(*(w for _, w in _widths(cfg))))


def check_tp(cfg: ModelArgs, tp: int) -> None:
    """Reject a TP degree that does not divide the heads or the MLP width (or, with grouped-query
    attention, neither divides nor is a multiple of the KV heads), naming the valid ones."""
    bad = [f"does not divide {what}={n}" for what, n in (("n_head", cfg.n_head), *_widths(cfg)) if n % tp]
    if cfg.kv_heads != cfg.n_head and not kv_fits(cfg.kv_heads, tp):
        bad.append(f"neither divides nor is a multiple of n_kv_head={cfg.kv_heads}")
    if bad:
        raise ValueError(f"tp={tp} {' and '.join(bad)}; valid tp degrees: "
                         f"{', '.join(map(str, valid_tp_degrees(cfg)))}")
