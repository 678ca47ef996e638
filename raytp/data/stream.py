"""A token stream: pieces of memory-mapped id arrays read as one sequence, without copying them together.

A prepared dataset's shards, or the documents of a split held out from them, are pieces of files on disk; a
training window reads a few thousand ids at some offset of their concatenation (`read`). Only the pieces'
offsets live in memory (one int64 each); the ids stay in the page cache, shared by every worker of a node.
"""
from __future__ import annotations

import numpy as np


class Stream:
    def __init__(self, pieces: list[np.ndarray]):
        self.pieces = [p for p in pieces if len(p)]
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in self.pieces], dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """ids [start, start + length) as int64."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) of a stream of {len(self)}")
        out = np.empty(length, dtype=np.int64)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            piece, at = self.pieces[k], start + done - int(self.starts[k])
            take = min(length - done, len(piece) - at)
            out[done:done + take] = piece[at:at + take]
            done, k = done + take, k + 1
        return out

    def rows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """ids [start, start + length) for each of `starts`, as an int64 array (len(starts), length): one
        gather per piece for the rows inside it (most of them), a `read` for a row across two pieces."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), dtype=np.int64)
        k = np.searchsorted(self.starts, starts, side="right") - 1
        inside = starts + length <= self.starts[np.minimum(k + 1, len(self.pieces))]
        for piece in np.unique(k[inside]).tolist():
            sel = np.flatnonzero(inside & (k == piece))
            at = starts[sel] - self.starts[piece]
            out[sel] = self.pieces[piece][at[:, None] + np.arange(length)]
        for row in np.flatnonzero(~inside).tolist():
            out[row] = self.read(int(starts[row]), length)
        return out

    @staticmethod
    def of(array: np.ndarray, ranges) -> "Stream":
        """The stream of `array`'s [start, end) ranges, in order."""
        return Stream([array[a:b] for a, b in ranges])


def held_per_file(doc_counts: list[int], fraction: float) -> list[int] | None:
    """How many of each file's documents a source holds out for validation: `fraction` of all its documents,
    spread over its files in proportion (so a source of many small files holds out whole documents from a
    few of them, not one from each), every file keeping one for training. None when that makes no whole
    document: the source's last tokens are held out instead (`tail`)."""
    counts = np.asarray(doc_counts, dtype=np.int64)
    held = min(round(int(counts.sum()) * fraction), int((counts - 1).clip(min=0).sum()))
    return _shares(held, counts) if held >= 1 else None


def tail(tokens: int, fraction: float) -> int:
    """Where a split by tokens starts its validation tail: `fraction` of `tokens`, at least one."""
    return tokens - max(int(tokens * fraction), 1)


def hold_out(doc_ends: np.ndarray, held: int, groups: int = 16) -> tuple[list, list]:
    """Token ranges (train, val) of a file of documents (`doc_ends`: each document's end offset, ascending)
    holding out `held` whole documents (fewer than it has) for validation, spread over the file in up to
    `groups` runs (the last documents of each of `groups` equal stretches), so a file that is a mix of sources
    keeps some of each for validation."""
    n, total = len(doc_ends), int(doc_ends[-1]) if len(doc_ends) else 0
    if held <= 0:
        return [(0, total)], []
    g = min(groups, held, n - held)
    bounds = np.linspace(0, n, g + 1).round().astype(np.int64)  # document index where each stretch starts
    per = _shares(held, np.diff(bounds))
    train, val = [], []
    start = 0
    for i in range(g):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        cut_doc = hi - per[i]
        begin = int(doc_ends[lo - 1]) if lo else 0
        cut, end = int(doc_ends[cut_doc - 1]), int(doc_ends[hi - 1])
        train.append((start if i == 0 else begin, cut))
        if end > cut:
            val.append((cut, end))
        start = end
    return _merge(train), _merge(val)


def _shares(held: int, sizes: np.ndarray) -> list[int]:
    """`held` documents over stretches of `sizes` documents, about in proportion, each stretch keeping one
    (held < sizes.sum() - len(sizes) + 1 for it to fit)."""
    cum = np.round(held * np.cumsum(sizes) / sizes.sum()).astype(np.int64)
    per = np.minimum(np.diff(np.concatenate([[0], cum])), sizes - 1)
    for i in range(len(per)):  # what a stretch could not hold goes to the next ones with room
        while per.sum() < held and per[i] < sizes[i] - 1:
            per[i] += 1
    return per.tolist()


def _merge(ranges: list) -> list:
    out = []
    for a, b in ranges:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
