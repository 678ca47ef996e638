"""The TP plan of GPT-2 (raytp.models.gpt2.model), applied by raytp.models.shard.apply_tp.

1. token embedding -> VocabParallelEmbedding (rows by vocab, padded to a
   multiple of tp); the LM head becomes a ColumnParallelLinear over the *same*
   vocab shard, so the tie survives; the loss becomes vocab-parallel.
2. per block: attention q/k/v -> column-parallel by whole heads, the output
   projection -> row-parallel; MLP c_fc -> column-, c_proj -> row-parallel.
3. with sequence parallelism: position embedding and dropout sites see the
   rank's slice of the sequence; LayerNorm gradients are summed over TP.
``SHARDING`` says how each parameter splits (raytp.parallel.placements.Shard; the arithmetic:
raytp.parallel.sharding).
"""
from __future__ import annotations

import torch.nn as nn

from raytp.models.gpt2.model import GPT
from raytp.parallel import comm
from raytp.parallel.layers import (ColumnParallelLinear, RowParallelLinear, SequenceShardedPositionEmbedding,
                                   VocabParallelCrossEntropy, VocabParallelEmbedding)
from raytp.parallel.placements import Shard

SHARDING: tuple[tuple[str, Shard], ...] = (  # (regex over parameter names, split); others replicated
    (r"(wte|lm_head)\.weight", Shard(0, pad=True)),
    (r"h\.\d+\.attn\.c_attn\.(weight|bias)", Shard(0, parts=3)),
    (r"h\.\d+\.mlp\.c_fc\.(weight|bias)", Shard(0)),
    (r"h\.\d+\.(attn|mlp)\.c_proj\.weight", Shard(1)),
)


def swap_parallel(model: GPT, group, sequence_parallel: bool, sliced, rank: int, tp: int, experts=None) -> None:
    cfg = model.cfg
    # 1. vocabulary: embedding, tied head, loss.
    start = rank * (-(-cfg.vocab_size // tp))  # the padded vocabulary's rows per rank
    if model.wte is not None:  # a pipeline stage may hold neither (raytp.models.stage)
        wte = sliced("wte.weight", model.wte.weight)
        model.wte = VocabParallelEmbedding(wte, start, group, sequence_parallel)
    if model.lm_head is not None:  # tied: the last stage holds the embedding too
        model.lm_head = ColumnParallelLinear(model.wte.weight, None, group, sequence_parallel)
        model.criterion = VocabParallelCrossEntropy(start, cfg.vocab_size, group)
    # 2. blocks.
    for i, block in model.h.items():
        for path, cls in (("attn.c_attn", ColumnParallelLinear), ("attn.c_proj", RowParallelLinear),
                          ("mlp.c_fc", ColumnParallelLinear), ("mlp.c_proj", RowParallelLinear)):
            owner_name, leaf = path.split(".")
            owner, old = getattr(block, owner_name), block.get_submodule(path)
            prefix = f"h.{i}.{path}"
            setattr(owner, leaf, cls(sliced(prefix + ".weight", old.weight), sliced(prefix + ".bias", old.bias),
                                     group, sequence_parallel))
        block.attn.head_offset = rank * cfg.n_head // tp


def tag(model: GPT, group, sequence_parallel: bool, rank: int, tp: int) -> None:
    """3. sequence parallelism: the residual stream is split along T."""
    if not sequence_parallel:
        return
    if model.wpe is not None:
        model.wpe = SequenceShardedPositionEmbedding(model.wpe.weight.detach(), group)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            for p in m.parameters():
                p.sequence_parallel = True
    blocks = list(model.h.values())
    for d in [model.drop] + [b.attn.resid_dropout for b in blocks] + [b.mlp.dropout for b in blocks]:
        d.shard = (comm.SEQ_DIM, rank, tp)
