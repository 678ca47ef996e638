"""The TP plan of a Llama (raytp.models.llama.model), applied by raytp.models.shard.apply_tp.

1. vocabulary: the token embedding -> VocabParallelEmbedding; the output head
   -> a ColumnParallelLinear over the same vocabulary shard (the embedding's
   own weight when tied); the loss -> vocab-parallel.
2. per block, attention: one ParallelInput (Megatron's f, or the sequence
   all-gather under SP) feeds q, k and v, each a ShardedLinear: query heads
   split by head; key/value heads split by KV head while tp divides n_kv_head,
   else each rank holds a copy of the one KV head its query heads use, the
   copies' gradients summed over the ranks sharing them (raytp.train.step);
   o_proj row-parallel (g, or the reduce-scatter under SP).
3. per block, MLP: one ParallelInput feeds gate and up (column-parallel); down
   is row-parallel. An MoE layer's experts split the same way (raytp.models.moe.plan).
So each block costs two all-reduces forward and two backward, as Megatron's.
4. with sequence parallelism, the RMSNorm weights see only this rank's slice
   of the sequence: their gradients are summed over TP by the step.
"""
from __future__ import annotations

from raytp.parallel.layers import (ColumnParallelLinear, ParallelInput, RowParallelLinear, ShardedLinear,
                                   VocabParallelCrossEntropy, VocabParallelEmbedding)
from raytp.models.moe import plan as moe_plan
from raytp.models.moe.layer import MoE
from raytp.models.spec import KV_HEADS
from raytp.parallel.placements import Shard

SHARDING: tuple[tuple[str, Shard], ...] = (  # (regex over parameter names, split); others replicated
    (r"(embed_tokens|lm_head)\.weight", Shard(0, pad=True)),
    (r"layers\.\d+\.self_attn\.q_proj\.(weight|bias)", Shard(0)),
    (r"layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)", KV_HEADS),
    (r"layers\.\d+\.mlp\.(gate|up)_proj\.weight", Shard(0)),
    (r"layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight", Shard(1)),
    *moe_plan.SHARDING,
)

BLOCK_PARTS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
               ("mlp", ("gate_proj", "up_proj"), "down_proj"))


def swap_parallel(model, group, sequence_parallel: bool, sliced, rank: int, tp: int, experts=None) -> None:
    """Swap in the TP layers (at tp > 1) and place the expert layers' experts (`experts`: this rank's
    raytp.models.moe.plan.ExpertPlace; None: every expert here, split over TP)."""
    place = experts or moe_plan.ExpertPlace()
    for i, block in model.layers.items():
        if isinstance(block.mlp, MoE):
            moe_plan.parallelize(block.mlp, f"layers.{i}.mlp", group if tp > 1 else None, sequence_parallel,
                                 sliced, place)
    if tp == 1:
        return
    cfg = model.cfg
    vocab_shard = -(-cfg.vocab_size // tp)  # the padded vocabulary's rows per rank
    start = rank * vocab_shard
    if model.embed_tokens is not None:  # a pipeline stage may hold neither (raytp.models.stage)
        emb = sliced("embed_tokens.weight", model.embed_tokens.weight)
        model.embed_tokens = VocabParallelEmbedding(emb, start, group, sequence_parallel)
    if model.lm_head is not None:
        head = model.embed_tokens.weight if cfg.tied else sliced("lm_head.weight", model.lm_head.weight)
        model.lm_head = ColumnParallelLinear(head, None, group, sequence_parallel)
        model.criterion = VocabParallelCrossEntropy(start, cfg.vocab_size, group)
    for i, block in model.layers.items():
        for part, columns, row in BLOCK_PARTS:
            mod, prefix = getattr(block, part), f"layers.{i}.{part}"
            if isinstance(mod, MoE):
                continue
            mod.tp_in = ParallelInput(group, sequence_parallel)
            for leaf in columns:
                bias = getattr(mod, leaf).bias  # Qwen2's q/k/v biases, split as their rows
                setattr(mod, leaf, ShardedLinear(sliced(f"{prefix}.{leaf}.weight", getattr(mod, leaf).weight),
                                                 None if bias is None else sliced(f"{prefix}.{leaf}.bias", bias)))
            mod.tp_in.consumers = [getattr(mod, leaf) for leaf in columns]  # its only readers (model.py)
            setattr(mod, row, RowParallelLinear(sliced(f"{prefix}.{row}.weight", getattr(mod, row).weight), None,
                                                group, sequence_parallel))


def tag(model, group, sequence_parallel: bool, rank: int, tp: int) -> None:
    """Mark the parameters whose gradients the step must sum over TP ranks (once every one is made):
    shared KV-head copies, an MoE layer's router, Qwen3's q/k head norms, and, under SP, the RMSNorm weights."""
    kv = Shard(0, heads=model.cfg.kv_heads)
    for block in model.layers.values():
        if isinstance(block.mlp, MoE):
            moe_plan.tag(block.mlp)
        if hasattr(block.self_attn, "q_norm"):  # each rank normalises its own heads: partial gradients
            block.self_attn.q_norm.weight.partial_over_tp = True
            block.self_attn.k_norm.weight.partial_over_tp = True
        if kv.holders(tp) > 1:
            for proj in (block.self_attn.k_proj, block.self_attn.v_proj):
                for p in (proj.weight, proj.bias):
                    if p is not None:
                        p.shared_head = (rank // kv.holders(tp), kv.heads, kv.holders(tp))
        if sequence_parallel:
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                norm.weight.sequence_parallel = True
    if sequence_parallel and model.norm is not None:
        model.norm.weight.sequence_parallel = True
