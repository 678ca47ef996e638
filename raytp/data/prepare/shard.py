"""One shard: its pieces read, encoded and written, by whoever runs it (a Ray task, or prepare_local).

The shard is Megatron-LM's indexed format (raytp.data.indexed): ``shard-NNNNN.bin``, each document's ids
followed by the end-of-document id, one sequence per document, and ``shard-NNNNN.idx``. The .bin is
streamed as batches are encoded (a shard is never whole in memory, only its document lengths). On a
filesystem both go under a temporary name and are renamed into place; an object store makes an object
visible only once it is whole, so they are written in place. Either way a shard is only part of a dataset
once the manifest, written last by the driver, names it.
"""
from __future__ import annotations

import os
import uuid
from collections import Counter
from contextlib import contextmanager

import numpy as np

from raytp.data.indexed import index_bytes
from raytp.data.prepare import chat, read
from raytp.data.prepare.plan import Piece
from raytp.data.prepare.inputs import File
from raytp.files.storage import Storage

BATCH_CHARS = 1 << 20   # text per encode_batch call: large enough to amortize the call, small in memory
TMP = ".tmp-"           # the prefix of a shard file being written (filesystems)
BATCH_ROWS = 256        # conversations rendered and encoded per encode_batch call
MASK = ".mask"          # a conversations shard's trained mask, one uint8 per token
_TOKENIZERS: dict[str, object] = {}  # sha256 -> Tokenizer, built once per process


def prefix(index: int) -> str:
    return f"shard-{index:05d}"


def _tokenizer(tok_json: str, sha: str):
    if sha not in _TOKENIZERS:
        from tokenizers import Tokenizer
        _TOKENIZERS[sha] = Tokenizer.from_str(tok_json)
    return _TOKENIZERS[sha]


@contextmanager
def _written(store: Storage, name: str):
    """A file to write `name` through: under a temporary name renamed into place when done (filesystems),
    else the object itself."""
    if not store.local:
        with store.open_write(name) as f:
            yield f
        return
    tmp = f"{TMP}{uuid.uuid4().hex[:8]}-{name}"
    try:
        with store.open_write(tmp) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(store.path(tmp), store.path(name))
    finally:
        store.remove(tmp)  # gone already unless writing failed


def _batches(files: list[File], pieces: tuple[Piece, ...], key: str):
    batch, chars = [], 0
    for piece in pieces:
        for text in read.documents(files[piece.file], piece, key):
            batch.append(text)
            chars += len(text)
            if chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def encode(tok, texts: list[str], eod_id: int, dtype) -> tuple[np.ndarray, list[int]]:
    """The ids of a batch of documents, each followed by `eod_id`, and each one's length. ``encode_batch_fast``
    gives the ids of ``encode_batch`` without the character offsets, which a token dataset never needs (about
    1.5x the rate on a byte-level BPE: bench/prepare)."""
    encodings = tok.encode_batch_fast(texts, add_special_tokens=False)
    sizes = [len(e.ids) + 1 for e in encodings]
    ids = np.empty(sum(sizes), dtype=dtype)
    at = 0
    for e, n in zip(encodings, sizes):
        ids[at:at + n - 1] = e.ids
        ids[at + n - 1] = eod_id
        at += n
    return ids, sizes


def _rows(files: list[File], pieces: tuple[Piece, ...], key: str):
    batch = []
    for piece in pieces:
        for row in read.documents(files[piece.file], piece, key, read.CONVERSATIONS):
            batch.append(row)
            if len(batch) >= BATCH_ROWS:
                yield batch
                batch = []
    if batch:
        yield batch


def _write_conversations(index: int, pieces, files, tok_json: str, tok_sha: str, dtype: str, store: Storage,
                         key: str, chat_spec: dict) -> dict:
    """A shard of conversations: each good row's ids (its rendering, which ends its own turns: no end-of-
    document id is added) in the .bin, one document each, and its trained mask (uint8, 1 = trained on) in
    ``.mask``; the bad rows counted by reason."""
    tok = chat.renderer(tok_json, chat_spec)
    sizes, bad, trained = [], Counter(), 0
    with _written(store, prefix(index) + ".bin") as fb, _written(store, prefix(index) + MASK) as fm:
        for rows in _rows(files, pieces, key):
            good, reasons = chat.encode(tok, rows)
            bad.update(reasons)
            for ids, mask in good:
                fb.write(ids.astype(dtype).tobytes())
                fm.write(mask.tobytes())
                sizes.append(len(ids))
                trained += int(mask.sum())
    with _written(store, prefix(index) + ".idx") as f:
        f.write(index_bytes(np.asarray(sizes, dtype=np.int64), np.dtype(dtype)))
    return {"index": index, "documents": len(sizes), "tokens": int(sum(sizes)), "trained": trained,
            "bad": dict(bad)}


def write_shard(index: int, pieces: tuple[Piece, ...], files: list[File], tok_json: str, tok_sha: str,
                eod_id: int, dtype: str, out: str, key: str, chat_spec: dict | None = None) -> dict:
    """Encode shard `index` (its pieces of `files`) and write it to the dataset at `out`; its documents and
    tokens (of conversations, `chat_spec` given: also its trained tokens and bad rows by reason). ValueError
    naming the file (and line) of bad input."""
    store = Storage(out)
    if chat_spec is not None:
        return _write_conversations(index, pieces, files, tok_json, tok_sha, dtype, store, key, chat_spec)
    tok = _tokenizer(tok_json, tok_sha)
    sizes: list[int] = []
    with _written(store, prefix(index) + ".bin") as f:
        for texts in _batches(files, pieces, key):
            ids, n = encode(tok, texts, eod_id, dtype)
            f.write(ids.tobytes())
            sizes.extend(n)
    with _written(store, prefix(index) + ".idx") as f:
        f.write(index_bytes(np.asarray(sizes, dtype=np.int64), np.dtype(dtype)))
    return {"index": index, "documents": len(sizes), "tokens": int(sum(sizes))}
