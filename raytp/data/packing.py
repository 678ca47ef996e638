"""Whole documents (conversations) packed into training rows: a pure function of the documents, the block
size and the seed, so every rank, a resize and a recovery see the same rows.

A document of L tokens fills L - 1 positions of a row (inputs d[:-1], targets d[1:], as transformers trains
it alone); one longer than the row (L - 1 > block) is truncated to its first block + 1 tokens, or, with
``too_long="drop"``, left out; both are counted. With ``pack`` the documents, in a seeded order, go first-fit
into rows (the first of the last OPEN rows with room; the rows before are all but full), else one per row.
What a row leaves free is padding: input 0, target -1, a document id of its own.

The packing is made once per (split, source, block size, seed); each epoch then reads its rows in a fresh
seeded permutation (raytp.data.sampling.windows), as windows of a token stream are read. A row carries its
documents' ids (raytp.models.documents), so attention stays within each and positions restart at each; a
target is -1 (not trained on) where the dataset's mask says so (raytp.data.prepare.chat) and at padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raytp.data.sampling import permute
from raytp.seeds import derive_seed

OPEN = 256  # rows first-fit looks back over
TOO_LONG = ("truncate", "drop", "refuse")  # refuse: packed as truncate (a job with any is refused first)


@dataclass(frozen=True)
class Packing:
    starts: np.ndarray     # each placed document's first token in the stream, in row order
    lengths: np.ndarray    # tokens of it read (truncated: block + 1)
    row_starts: np.ndarray  # index into starts where each row's documents begin (len rows + 1)
    too_long: int          # documents longer than a row: cut, or left out (too_long="drop")
    short: int             # documents of one token, left out (nothing to predict)

    @property
    def rows(self) -> int:
        return len(self.row_starts) - 1


def plan(doc_ends: np.ndarray, block: int, seed: int, pack: bool = True, too_long: str = "truncate") -> Packing:
    """The packing of documents ending at `doc_ends` (ascending offsets in their stream) into rows of
    `block` positions."""
    if too_long not in TOO_LONG:
        raise ValueError(f"data.too_long: {too_long!r}; valid: {', '.join(TOO_LONG)}")
    ends = np.asarray(doc_ends, dtype=np.int64)
    begins = np.concatenate([[0], ends[:-1]])
    need = ends - begins - 1  # positions each fills
    long = need > block
    keep = (need >= 1) & ~(long & (too_long == "drop"))
    need = np.minimum(need, block)
    order = permute(np.arange(len(ends)), len(ends), derive_seed(seed, 7)) if len(ends) else ends
    order = order[keep[order]]
    if pack:
        row_of = _first_fit(need[order], block)
    else:
        row_of = np.arange(len(order), dtype=np.int64)
    by_row = np.argsort(row_of, kind="stable")  # documents of a row in the order they were placed
    docs = order[by_row]
    counts = np.bincount(row_of, minlength=int(row_of.max()) + 1 if len(row_of) else 0)
    row_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Packing(begins[docs], need[docs] + 1, row_starts, int(long.sum()), int((need < 1).sum()))


def _first_fit(need: np.ndarray, block: int) -> np.ndarray:
    """The row of each document (positions `need`), first-fit over the last OPEN rows."""
    free = np.empty(len(need), dtype=np.int64)  # each row's free positions; rows [0, used) exist
    row_of = np.empty(len(need), dtype=np.int64)
    lo = used = 0  # rows before lo are closed
    for i, n in enumerate(need.tolist()):
        fits = np.flatnonzero(free[lo:used] >= n)
        if len(fits):
            r = lo + int(fits[0])
        else:
            r, used = used, used + 1
            free[r] = block
            lo = max(lo, used - OPEN)
        free[r] -= n
        row_of[i] = r
    return row_of


def rows(p: Packing, stream, mask, which: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows `which` of packing `p` over token `stream` and its trained `mask` (raytp.data.stream.Stream, or
    None: every target trained): (x, y, documents), each (len(which), block) int64."""
    n = len(which)
    x = np.zeros((n, block), dtype=np.int64)
    y = np.full((n, block), -1, dtype=np.int64)
    ids = np.empty((n, block), dtype=np.int64)
    for i, r in enumerate(np.asarray(which).tolist()):
        at = 0
        a, b = int(p.row_starts[r]), int(p.row_starts[r + 1])
        for k, j in enumerate(range(a, b)):
            start, length = int(p.starts[j]), int(p.lengths[j])
            toks = stream.read(start, length)
            x[i, at:at + length - 1] = toks[:-1]
            trained = np.ones(length - 1, dtype=bool) if mask is None else mask.read(start + 1, length - 1) > 0
            y[i, at:at + length - 1] = np.where(trained, toks[1:], -1)
            ids[i, at:at + length - 1] = k
            at += length - 1
        ids[i, at:] = b - a  # padding: a document of its own
    return x, y, ids
