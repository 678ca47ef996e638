"""A model's TP shard: apply_tp turns a model into the local shard of one TP rank.

What to swap and how each parameter splits is the model's spec's (raytp.models:
``parallelize``, ``tag`` and the ``sharding`` table, applied from outside, as
torchtitan does). A shard is built from a model on the meta device (shapes
only) and a *source* of this rank's slices: the seeded initialisation, which
computes only those slices (``build_shard``), or empty storage to load into
(``build_empty_shard``); so no process ever holds the whole model. Given a
materialised one-device model instead, ``apply_tp`` cuts the slices out of it.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from raytp.initialization import values
from raytp.models.args import ModelArgs
from raytp.models.base import CausalLM
from raytp.models.moe.grouped import pack
from raytp.models.stage import Stage, keep_stage
from raytp.models.registry import check_tp, full_size_of, model_class, spec, split_of
from raytp.parallel import comm
from raytp.parallel.placements import REPLICATE
from raytp.parallel.sharding import local_shape, shard_ranges, shard_tensor, unshard_tensors


def apply_tp(model: CausalLM, group, sequence_parallel: bool = False, source=None, experts=None) -> CausalLM:
    """Make `model` this rank's TP shard, in place; returns it. `group`: the TP process group (None or
    one rank: nothing is split); `experts`: where this rank's experts are (raytp.models.moe.plan.ExpertPlace;
    None: all of them here).

    `source(name, full_shape, sharding, rank, tp)` gives this rank's slice of each parameter (a model
    built on the meta device is shapes only: every parameter comes from the source, so nothing of the
    whole model is ever allocated). Without a source the slices are cut from the model's own weights."""
    tp, rank = comm.group_size(group), comm.group_rank(group)
    if tp > 1:
        check_tp(model.cfg, tp)
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

    def sliced(name: str, t: torch.Tensor | None, whole: bool = False):
        if t is None:
            return None
        s = REPLICATE if whole else split_of(name, model.cfg)
        if source is not None:
            return source(name, full_shapes[name], s, rank, tp)
        return shard_tensor(t, s, rank, tp)

    plan = spec(model.cfg)
    if tp > 1 or (experts is not None and experts.ep > 1):
        plan.parallelize(model, group, sequence_parallel, sliced, rank, tp, experts=experts)
    if source is not None:  # what is left on meta (the replicated parameters; all of them at tp=1)
        made: dict[int, nn.Parameter] = {}  # a tied parameter is made once
        for mod_name, mod in model.named_modules():
            for leaf, p in list(mod.named_parameters(recurse=False)):
                if p.is_meta:
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(sliced(f"{mod_name}.{leaf}" if mod_name else leaf, p),
                                                   requires_grad=p.requires_grad)
                    setattr(mod, leaf, made[id(p)])
    if tp > 1:  # once every parameter is made: what the step must sum over TP, and SP's slices
        plan.tag(model, group, sequence_parallel, rank, tp)
    return model


def rebind_groups(model: nn.Module, groups) -> None:
    """Point every parallel layer at its group in `groups` (a raytp.parallel.groups.ProcessGroups, after
    the groups were rebuilt; None: drop them all), each by the mesh axis it names (``group_axis``). A
    module holding a group but naming no axis is an error, never guessed."""
    for m in model.modules():
        if hasattr(m, "group"):
            axis = getattr(type(m), "group_axis", None)
            if axis is None:
                raise TypeError(f"{type(m).__name__} holds a process group but names no mesh axis (group_axis)")
            m.group = None if groups is None else groups.group(axis)


def build_shard(cfg: ModelArgs, seed: int, group, sequence_parallel: bool = False,
                device: torch.device | str = "cpu", stage: Stage | None = None, experts=None) -> CausalLM:
    """The local shard of a model initialised from `seed`, on `device`: only this rank's slices are
    computed (raytp.initialization), and they are build_model(cfg, seed)'s numbers there, at every TP
    degree. `stage`: only a pipeline stage's part (raytp.models.stage), the same numbers there."""
    def initial(name, full_shape, s, rank, tp):
        rule = model_class(cfg).init_rule(name, cfg)
        if s.dim is None or tp == 1:
            return values(name, rule, seed, full_shape).to(device)
        region = [slice(0, n) for n in full_shape]
        parts = []
        for r in shard_ranges(s, full_shape[s.dim], rank, tp):
            region[s.dim] = slice(r.start, r.stop)
            parts.append(values(name, rule, seed, full_shape, tuple(region)))
        return torch.cat(parts, dim=s.dim).to(device)
    return _shard_of_meta(cfg, group, sequence_parallel, initial, stage, experts)


def build_empty_shard(cfg: ModelArgs, group, sequence_parallel: bool = False,
                      device: torch.device | str = "cpu", stage: Stage | None = None, experts=None) -> CausalLM:
    """The local shard as build_shard makes it, on `device`, with UNINITIALISED weights: for a shard
    whose state is loaded right after (a resume, a resize)."""
    def empty(name, full_shape, s, rank, tp):
        return torch.empty(local_shape(s, full_shape, tp), device=device)
    return _shard_of_meta(cfg, group, sequence_parallel, empty, stage, experts)


def _shard_of_meta(cfg: ModelArgs, group, sequence_parallel: bool, source, stage: Stage | None,
                   experts) -> CausalLM:
    with torch.device("meta"):
        model = keep_stage(model_class(cfg)(cfg), stage)  # shapes only: builds no tensor and runs no op
    model = apply_tp(model, group, sequence_parallel, source, experts)
    for layer in model.modules():  # each expert layer's local experts' weights back to back (grouped GEMMs)
        if hasattr(layer, "experts") and isinstance(layer.experts, torch.nn.ModuleDict):
            pack(list(layer.experts.values()))
    return model


@torch.no_grad()
def gather_full_state(model: CausalLM, group) -> dict[str, torch.Tensor]:
    """The one-device state_dict of a TP-sharded model (every rank of `group` must call it)."""
    tp = comm.group_size(group)
    out = {}
    for name, p in model.named_parameters():  # the tied head appears once, as wte.weight
        s = split_of(name, model.cfg)
        if tp == 1 or s.dim is None:
            out[name] = p.detach().clone()
            continue
        parts = [torch.empty_like(p) for _ in range(tp)]
        torch.distributed.all_gather(parts, p.detach().contiguous(), group=group)
        out[name] = unshard_tensors(parts, s, full_size_of(name, model.cfg))
    return out
