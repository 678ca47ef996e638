"""apply_tp: turn a built one-device GPT into the local shard of one TP rank.

The plan, in the order it is applied (torchtitan's "parallelize from outside"):

1. token embedding -> VocabParallelEmbedding (rows by vocab, padded to a
   multiple of tp); the LM head becomes a ColumnParallelLinear over the *same*
   vocab shard, so the tie survives; the loss becomes vocab-parallel.
2. per block: attention q/k/v -> column-parallel by whole heads (q, k and v
   sliced separately, so rank i owns heads [i*nh/p, (i+1)*nh/p) of each), the
   output projection -> row-parallel; MLP c_fc -> column-, c_proj -> row-parallel.
3. with sequence parallelism: position embedding and dropout sites see the
   rank's slice of the sequence.

Weights are *sliced* from the model's full initialisation, so every layout
starts from the same numbers. ``SHARDING`` describes the slicing of every
parameter; ``shard_tensor`` / ``unshard_tensors`` apply and invert it, for
weights and for optimizer state alike (checkpoints and resharding use them).
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from raytp.model import GPT, GPTConfig
from raytp.parallel import comm
from raytp.parallel.layers import (ColumnParallelLinear, RowParallelLinear, SequenceShardedPositionEmbedding,
                                   VocabParallelCrossEntropy, VocabParallelEmbedding)


@dataclass(frozen=True)
class Sharding:
    """How one parameter is split over tp ranks: along `dim` (None = replicated),
    as `parts` independent blocks (3 for fused q, k, v), padded along dim to a
    multiple of tp when `pad` is set (the vocabulary)."""

    dim: int | None = None
    parts: int = 1
    pad: bool = False


REPLICATED = Sharding()
SHARDING: list[tuple[str, Sharding]] = [  # (regex over parameter names, sharding)
    (r"(wte|lm_head)\.weight", Sharding(dim=0, pad=True)),
    (r"h\.\d+\.attn\.c_attn\.(weight|bias)", Sharding(dim=0, parts=3)),
    (r"h\.\d+\.mlp\.c_fc\.(weight|bias)", Sharding(dim=0)),
    (r"h\.\d+\.(attn|mlp)\.c_proj\.weight", Sharding(dim=1)),
]


def sharding_of(name: str) -> Sharding:
    for pattern, s in SHARDING:
        if re.fullmatch(pattern, name):
            return s
    return REPLICATED


def padded_vocab(vocab_size: int, tp: int) -> int:
    return math.ceil(vocab_size / tp) * tp


def valid_tp_degrees(cfg: GPTConfig) -> list[int]:
    g = math.gcd(cfg.n_head, 4 * cfg.n_embd)
    return [d for d in range(1, g + 1) if g % d == 0]


def check_tp(cfg: GPTConfig, tp: int) -> None:
    """Reject a TP degree that does not divide the heads or the MLP width, naming the valid ones."""
    bad = [f"{what}={n}" for what, n in (("n_head", cfg.n_head), ("mlp width 4*n_embd", 4 * cfg.n_embd)) if n % tp]
    if bad:
        raise ValueError(f"tp={tp} does not divide {' and '.join(bad)}; valid tp degrees: "
                         f"{', '.join(map(str, valid_tp_degrees(cfg)))}")


def shard_tensor(full: torch.Tensor, s: Sharding, rank: int, tp: int) -> torch.Tensor:
    """This rank's slice of a full tensor (a copy)."""
    if s.dim is None or tp == 1:
        return full.detach().clone()
    if s.pad and full.shape[s.dim] % tp:
        pad = [0, 0] * full.dim()
        pad[2 * (full.dim() - 1 - s.dim) + 1] = padded_vocab(full.shape[s.dim], tp) - full.shape[s.dim]
        full = nn.functional.pad(full, pad)
    blocks = [b.chunk(tp, dim=s.dim)[rank] for b in full.chunk(s.parts, dim=s.dim)]
    return torch.cat(blocks, dim=s.dim).detach().clone()


def unshard_tensors(shards: list[torch.Tensor], s: Sharding, full_size: int | None = None) -> torch.Tensor:
    """Inverse of shard_tensor over all ranks' slices, in one copy; `full_size` drops vocab padding."""
    if s.dim is None or len(shards) == 1:
        out = shards[0].detach().clone()
    else:  # blocks in order: part 0 of every rank, part 1 of every rank, ...
        per_rank = [sh.detach().chunk(s.parts, dim=s.dim) for sh in shards]
        out = torch.cat([pr[p] for p in range(s.parts) for pr in per_rank], dim=s.dim)
    if full_size is not None and s.dim is not None and out.shape[s.dim] != full_size:
        out = out.narrow(s.dim, 0, full_size).clone()
    return out


def full_size_of(name: str, cfg: GPTConfig) -> int | None:
    """The unpadded size along the sharded dim, for parameters that are padded."""
    return cfg.vocab_size if sharding_of(name).pad else None


def apply_tp(model: GPT, group, sequence_parallel: bool = False) -> GPT:
    """Make `model` (a full, initialised GPT) this rank's TP shard, in place; returns it.

    `group` is the TP process group (None or one rank: the model is left as is).
    """
    tp, rank = comm.group_size(group), comm.group_rank(group)
    if tp == 1:
        return model
    cfg = model.cfg
    check_tp(cfg, tp)

    def sliced(name: str, t: torch.Tensor | None):
        return None if t is None else shard_tensor(t, sharding_of(name), rank, tp)

    # 1. vocabulary: embedding, tied head, loss.
    wte = sliced("wte.weight", model.wte.weight)
    start = rank * wte.shape[0]
    model.wte = VocabParallelEmbedding(wte, start, group, sequence_parallel)
    model.lm_head = ColumnParallelLinear(model.wte.weight, None, group, sequence_parallel)
    model.criterion = VocabParallelCrossEntropy(start, cfg.vocab_size, group)

    # 2. blocks.
    for i, block in enumerate(model.h):
        for path, cls in (("attn.c_attn", ColumnParallelLinear), ("attn.c_proj", RowParallelLinear),
                          ("mlp.c_fc", ColumnParallelLinear), ("mlp.c_proj", RowParallelLinear)):
            owner_name, leaf = path.split(".")
            owner, old = getattr(block, owner_name), block.get_submodule(path)
            prefix = f"h.{i}.{path}"
            setattr(owner, leaf, cls(sliced(prefix + ".weight", old.weight), sliced(prefix + ".bias", old.bias),
                                     group, sequence_parallel))
        block.attn.head_offset = rank * cfg.n_head // tp

    # 3. sequence parallelism: the residual stream is split along T.
    if sequence_parallel:
        model.wpe = SequenceShardedPositionEmbedding(model.wpe.weight.detach(), group)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                for p in m.parameters():
                    p.sequence_parallel = True
        for d in [model.drop] + [b.attn.resid_dropout for b in model.h] + [b.mlp.dropout for b in model.h]:
            d.shard = (comm.SEQ_DIM, rank, tp)
    return model


def rebind_groups(model: nn.Module, group) -> None:
    """Point every parallel layer at a new TP group (after the groups were rebuilt)."""
    for m in model.modules():
        if hasattr(m, "group"):
            m.group = group


def build_shard(cfg: GPTConfig, seed: int, group, sequence_parallel: bool = False) -> GPT:
    """The local shard of a GPT initialised from `seed`: same numbers at every layout."""
    torch.manual_seed(seed)
    return apply_tp(GPT(cfg), group, sequence_parallel)


@contextlib.contextmanager
def _no_init():
    """torch.nn.init's in-place initialisers as no-ops: modules built inside keep torch.empty storage."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def build_empty_shard(cfg: GPTConfig, group, sequence_parallel: bool = False,
                      device: torch.device | str = "cpu") -> GPT:
    """The local shard as build_shard makes it, on `device`, with UNINITIALISED weights: for a shard
    whose state is loaded right after (a resize). It skips the seeded initialisation of the whole
    one-device model (the RNG work; the slicing copies remain, of uninitialised memory). Not the meta
    device: its first use in a process loads torch's Python meta kernels, seconds under load."""
    with torch.device(device), _no_init():
        return apply_tp(GPT(cfg), group, sequence_parallel)


@torch.no_grad()
def gather_full_state(model: GPT, group) -> dict[str, torch.Tensor]:
    """The one-device state_dict of a TP-sharded model (every rank of `group` must call it)."""
    tp = comm.group_size(group)
    out = {}
    for name, p in model.named_parameters():  # the tied head appears once, as wte.weight
        s = sharding_of(name)
        if tp == 1 or s.dim is None:
            out[name] = p.detach().clone()
            continue
        parts = [torch.empty_like(p) for _ in range(tp)]
        torch.distributed.all_gather(parts, p.detach().contiguous(), group=group)
        out[name] = unshard_tensors(parts, s, full_size_of(name, model.cfg))
    return out
