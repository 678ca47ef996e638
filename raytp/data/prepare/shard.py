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
from contextlib import contextmanager

import numpy as np

from raytp.data.indexed import index_bytes
from raytp.data.prepare import read
from raytp.data.prepare.plan import Piece
from raytp.data.prepare.inputs import File
from raytp.files.storage import Storage

BATCH_CHARS = 1 << 20   # text per encode_batch call: large enough to amortize the call, small in memory
TMP = ".tmp-"           # the prefix of a shard file being written (filesystems)
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


def write_shard(index: int, pieces: tuple[Piece, ...], files: list[File], tok_json: str, tok_sha: str,
                eod_id: int, dtype: str, out: str, key: str) -> dict:
    """Encode shard `index` (its pieces of `files`) and write it to the dataset at `out`; its documents and
    tokens. ValueError naming the file (and line) of bad input."""
    tok = _tokenizer(tok_json, tok_sha)
    store = Storage(out)
    sizes: list[int] = []
    with _written(store, prefix(index) + ".bin") as f:
        for texts in _batches(files, pieces, key):
            ids, n = encode(tok, texts, eod_id, dtype)
            f.write(ids.tobytes())
            sizes.extend(n)
    with _written(store, prefix(index) + ".idx") as f:
        f.write(index_bytes(np.asarray(sizes, dtype=np.int64), np.dtype(dtype)))
    return {"index": index, "documents": len(sizes), "tokens": int(sum(sizes))}
