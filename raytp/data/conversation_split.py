"""A prepared dataset of conversations opened for training: each split's document boundaries and trained
mask, beside its token streams (raytp.data.token_sources).

The mask (``shard-NNNNN.mask``, one uint8 per token: raytp.data.manifest) is memory-mapped as the ids are,
and cut by the same whole-document ranges as the ids of each split (raytp.data.stream.hold_out), so the
``i``-th token of a split's stream and the ``i``-th byte of its mask stream are one token. Each split's
documents are given by their end offsets in its stream: what raytp.data.packing packs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raytp.data import manifest as mf
from raytp.data.stream import Stream


@dataclass
class Documents:
    """A dataset of conversations' documents: each split's document end offsets (in its stream) and trained
    mask (a Stream of uint8 beside the tokens)."""
    train_ends: np.ndarray
    val_ends: np.ndarray | None
    train_mask: Stream
    val_mask: Stream | None


class Splitter:
    """Collects, shard by shard, the mask pieces and document ends of the train and val ranges."""

    def __init__(self):
        self.parts = {"train": ([], [], 0), "val": ([], [], 0)}  # (mask pieces, document ends, offset)

    def add(self, path: Path, shard: mf.Shard, tokens: int, ends: np.ndarray, train: list, val: list,
            name: str) -> None:
        """A shard's ranges (its document `ends`): `train` and `val` [(start, end)] of whole documents."""
        mask = _mask(path, shard, tokens, name)
        for split, ranges in (("train", train), ("val", val)):
            pieces, doc_ends, at = self.parts[split]
            for a, b in ranges:
                pieces.append(mask[a:b])
                doc_ends.append(ends[(ends > a) & (ends <= b)] - a + at)
                at += b - a
            self.parts[split] = (pieces, doc_ends, at)

    def documents(self, with_val: bool) -> Documents:
        (tm, te, _), (vm, ve, _) = self.parts["train"], self.parts["val"]
        return Documents(_cat(te), _cat(ve) if with_val else None, Stream(tm), Stream(vm) if with_val else None)


def _cat(ends: list) -> np.ndarray:
    return np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)


def _mask(path: Path, shard: mf.Shard, tokens: int, name: str) -> np.ndarray:
    """A conversations shard's trained mask (memory-mapped), one uint8 per token."""
    p = path / f"{shard.prefix}.mask"
    if not p.exists() or p.stat().st_size != tokens:
        raise ValueError(f"{name}: {p.name} is missing or not one byte per token of {shard.prefix}")
    return np.memmap(p, dtype=np.uint8, mode="r") if tokens else np.zeros(0, dtype=np.uint8)
