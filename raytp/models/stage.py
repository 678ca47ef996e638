"""A pipeline stage of a model: the blocks of its layers, the embedding on the first, the head on the last.

As torchtitan does, a stage is the whole model built on the meta device (shapes
only) with what the stage does not run deleted, before any weight is made:
tensor names stay global (``h.7.attn...`` on whichever stage holds layer 7),
so checkpoints, Hugging Face names and the TP plan's sharding table need no
change. The blocks are a ModuleDict keyed by global layer index for this reason.

With interleaved schedules a stage holds several chunks (model chunk c on
stage c % pp): their layers are not consecutive, and each forward names the
chunk's layers (``model(idx, hidden=x, layers=chunk)``).

Tied embeddings: the last stage's head needs the input embedding's weight, so
a last stage that is not also the first keeps its own copy of the embedding
(``wte``/``embed_tokens``, never used for input). The two copies start equal
(the same seeded values, the same checkpoint slice); the step sums their
gradients over the pair (raytp.train.step), counts the weight once in the
gradient norm, and only the first stage writes it (``replicated_copy``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from raytp.models.base import CausalLM
from raytp.parallel.pipeline.pp_split import layer_costs, split_layers, stage_layers


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of `pp`: `split` is the layers of every model chunk (chunk c on stage c % pp,
    consecutive layers in chunk order), `rank` this stage's index; `tied`: the model ties its head."""
    split: tuple[int, ...]
    pp: int
    rank: int
    tied: bool = False

    def chunk(self, c: int) -> tuple[int, ...]:
        """The global layer indices of model chunk `c`."""
        return tuple(stage_layers(list(self.split), c))

    @property
    def all_chunks(self) -> list[tuple[int, ...]]:
        return [self.chunk(c) for c in range(len(self.split))]

    @property
    def chunks(self) -> list[tuple[int, ...]]:
        """This stage's chunks, in order."""
        return [self.chunk(c) for c in range(self.rank, len(self.split), self.pp)]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(i for c in self.chunks for i in c)

    @property
    def first(self) -> bool:
        """It holds chunk 0: it embeds the tokens."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """It holds the last chunk: the head and the loss."""
        return self.rank == self.pp - 1

    @property
    def tied_copy(self) -> bool:
        """A last stage that holds its own copy of the tied embedding."""
        return self.tied and self.last and not self.first


def chunk_split(cfg, pp: int, v: int = 1, pp_layers: list[int] | None = None) -> list[int]:
    """Layers per model chunk (pp * v of them): `pp_layers` as given, else balanced by cost with the
    embedding on the first chunk and the head and its loss on the last (raytp.parallel.pipeline.pp_split)."""
    if pp_layers:
        return list(pp_layers)
    return list(_balanced(cfg, pp, v))


@functools.lru_cache(maxsize=64)
def _balanced(cfg, pp: int, v: int) -> tuple[int, ...]:
    llama = cfg.arch == "llama"
    embed, head, layer = layer_costs(cfg.n_embd, cfg.vocab_size, cfg.mlp_width, ffn_matmuls=3 if llama else 2,
                                     kv_ratio=cfg.kv_heads / cfg.n_head)
    return tuple(split_layers(cfg.n_layer, pp, embed_cost=embed, head_cost=head, layer_cost=layer, v=v))


def stage_of(cfg, pp: int, pp_rank: int, v: int = 1, pp_layers: list[int] | None = None) -> Stage | None:
    """The Stage of rank `pp_rank` of `pp` (None at pp == 1: the whole model, nothing deleted)."""
    if pp == 1:
        return None
    return Stage(tuple(chunk_split(cfg, pp, v, pp_layers)), pp, pp_rank, cfg.tied)


def keep_stage(model: CausalLM, stage: Stage | None) -> CausalLM:
    """Delete from `model` (best built on the meta device) what `stage` does not run; returns it."""
    if stage is None:
        return model
    blocks = model.block_dict()
    for key in list(blocks.keys()):
        if int(key) not in stage.layers:
            del blocks[key]
    parts = model.stage_parts()
    if not stage.first:
        for name in parts["first"]:
            if not (stage.tied_copy and name == parts["embedding"]):
                setattr(model, name, None)
    if not stage.last:
        for name in parts["last"]:
            setattr(model, name, None)
    model.stage = stage
    return model


def holds(parts: dict, stage: Stage | None, name: str) -> bool:
    """Whether `stage` holds parameter `name` (its global name) of a model whose ``stage_parts()`` are
    `parts`: what keep_stage keeps, told from the name alone (for counting without building)."""
    if stage is None:
        return True
    head, _, rest = name.partition(".")
    if head == parts["blocks"]:
        return int(rest.partition(".")[0]) in stage.layers
    if head in parts["first"]:
        return stage.first or (stage.tied_copy and head == parts["embedding"])
    if head in parts["last"]:
        return stage.last
    return True


def copied_name(parts: dict, stage: Stage | None) -> str | None:
    """The parameter `stage` holds as a copy another stage owns (the tied embedding on a last stage that is
    not the first), given its model's ``stage_parts()``; None if it holds none."""
    return f"{parts['embedding']}.weight" if stage is not None and stage.tied_copy else None


def replicated_copy(model: CausalLM, name: str) -> bool:
    """Whether parameter `name` of this stage is a copy another stage owns (the tied embedding on the last
    stage): it is written, snapshotted and counted in the gradient norm by the first stage only."""
    return name == copied_name(model.stage_parts(), getattr(model, "stage", None))
