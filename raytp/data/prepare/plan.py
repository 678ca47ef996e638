"""How a corpus is cut into shards: a pure function of its files (names, sizes, Parquet row groups) and the
shard size, never of the cluster, so the same inputs make the same dataset on any number of nodes.

A shard is a list of pieces read one after another: a byte range of an uncompressed JSON-lines file (the
lines that start in it: a line crossing the end belongs to the range it starts in), some row groups of a
Parquet file, or a whole file (a text file: one document; a compressed file: no random access). Pieces are
taken in file order until a shard holds about `shard_tokens` tokens of text (estimated at BYTES_PER_TOKEN
bytes each, COMPRESSION_RATIO for compressed bytes), so a shard is about that size and many small files
share one.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from raytp.data.prepare.inputs import File

BYTES_PER_TOKEN = 4       # text per token of a BPE vocabulary, about (English, code)
COMPRESSION_RATIO = 4     # text per byte of a compressed JSON-lines file, about
SHARD_TOKENS = 1 << 23    # default: ~8M tokens (~32 MB of text) per shard ...
SPREAD = 64               # ... fewer for a corpus of fewer shards than this (it is still many tasks at once) ...
MIN_SHARD_TOKENS = 1 << 20  # ... down to ~1M tokens a shard


@dataclass(frozen=True)
class Piece:
    file: int                          # index into the corpus's file list
    start: int = 0                     # byte range [start, end) of a splittable JSON-lines file
    end: int | None = None             # None: to the end of the file
    row_groups: tuple[int, ...] = ()   # Parquet: these row groups (none: a whole non-Parquet file)


def estimate(f: File) -> int:
    """Text bytes of a file, about."""
    return f.size * (COMPRESSION_RATIO if f.compression else 1)


def pieces_of(f: File, i: int, target: int, row_group_bytes: tuple[int, ...] = ()) -> list[tuple[Piece, int]]:
    """A file's pieces, each at most about `target` text bytes (one, if it cannot be split), with their sizes."""
    if f.kind == "parquet":
        out, group, size = [], [], 0
        for g, b in enumerate(row_group_bytes):
            if group and size + b > target:
                out.append((Piece(i, row_groups=tuple(group)), size))
                group, size = [], 0
            group.append(g)
            size += b
        return out + ([(Piece(i, row_groups=tuple(group)), size)] if group else [])
    if f.kind == "jsonl" and not f.compression and f.size > target:
        return [(Piece(i, s, min(s + target, f.size)), min(target, f.size - s)) for s in range(0, f.size, target)]
    return [(Piece(i), estimate(f))]


def shard_size(files: list[File]) -> int:
    """The default shard size for a corpus: SHARD_TOKENS, or smaller for a corpus of fewer than SPREAD such
    shards (down to MIN_SHARD_TOKENS), so that a small corpus is still encoded by many tasks at once (one
    8M-token shard would be one task on one CPU). A function of the files' sizes only, as the plan is."""
    tokens = sum(estimate(f) for f in files) // BYTES_PER_TOKEN
    return min(SHARD_TOKENS, max(tokens // SPREAD, MIN_SHARD_TOKENS))


def plan(files: list[File], shard_tokens: int, row_groups: dict[int, tuple[int, ...]]) -> list[tuple[Piece, ...]]:
    """The shards of a corpus, in order: each a tuple of pieces. `row_groups`: each Parquet file's row
    groups' sizes in bytes, by file index."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens: {shard_tokens}; a shard holds at least one token")
    target = shard_tokens * BYTES_PER_TOKEN
    shards, current, size = [], [], 0
    for i, f in enumerate(files):
        for piece, n in pieces_of(f, i, target, row_groups.get(i, ())):
            if current and size + n > target:
                shards.append(tuple(current))
                current, size = [], 0
            current.append(piece)
            size += n
    if current:
        shards.append(tuple(current))
    return shards


def fingerprint(files: list[File], tokenizer_sha: str, eod_id: int, text_key: str, shard_tokens: int,
                chat_template_sha: str | None = None) -> str:
    """What a prepared dataset was made from: its files (names, sizes, versions), the tokenizer, the
    end-of-document id, the text key, the shard size (and conversations' chat template). Equal fingerprints,
    equal datasets."""
    what = {"files": [asdict(f) for f in files], "tokenizer": tokenizer_sha, "eod": eod_id, "text_key": text_key,
            "shard_tokens": shard_tokens}
    if chat_template_sha is not None:
        what["chat_template"] = chat_template_sha
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
