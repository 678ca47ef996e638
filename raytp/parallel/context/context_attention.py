"""The attention of a model whose sequences are cut over a CP group (raytp.parallel.context): a module each
attention layer holds, bound to the CP group like every parallel layer to its axis's group.

Without a group (cp 1) it is not called: the layer attends over its whole sequence itself. With one, it runs
ring attention (raytp.parallel.context.ring_attention) or Ulysses (raytp.parallel.context.ulysses), as
``parallel.cp_attention`` says, on this rank's part of each sequence: queries, keys and values after the rotary embedding of their global
positions, the key/value heads unexpanded, and the document ids of its tokens where documents are packed.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from raytp.parallel.context.ring_attention import ring_attention
from raytp.parallel.context.ulysses import ulysses_attention

KINDS = {"ring": ring_attention, "ulysses": ulysses_attention}


class ContextAttention(nn.Module):
    group_axis = "cp"  # the mesh axis of its group (raytp.models.shard.rebind_groups)

    def __init__(self, kind: str = "ring"):
        super().__init__()
        self.group = None
        self.kind = kind

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, T_local, d) attention output of this rank's queries over the whole sequence."""
        return KINDS[self.kind](q, k, v, self.group, documents)


def bind(model: nn.Module, groups, kind: str) -> None:
    """Bind every module of `model` whose group is the CP axis's (ContextAttention, the MoE balance loss's
    SequenceSum) to this rank's CP group in `groups` (None at cp 1); each ContextAttention runs `kind`."""
    if kind not in KINDS:
        raise ValueError(f"no context-parallel attention {kind!r}; known: {', '.join(KINDS)}")
    for m in model.modules():
        if getattr(type(m), "group_axis", None) == "cp":
            m.group = groups.cp
        if isinstance(m, ContextAttention):
            m.kind = kind
