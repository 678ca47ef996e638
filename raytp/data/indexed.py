"""Token files on disk, memory-mapped: Megatron-LM's indexed dataset (``.bin`` + ``.idx``) and nanoGPT's ``.bin``.

Megatron-LM's ``tools/preprocess_data.py`` writes the token ids of every document, one after another, to
``NAME.bin`` and an index to ``NAME.idx`` (its ``MMapIndexedDataset``): the header ``b"MMIDIDX\\x00\\x00"``,
the version (u64 = 1), the ids' dtype code (u8), the number of sequences (u64) and of document boundaries
(u64), then each sequence's length (i32), its byte offset in the .bin (i64), and the document boundaries
(i64). Megatron writes uint16 ids below a vocabulary of 65,500 and int32 above; the index says which, so a
``.bin`` with an ``.idx`` beside it is always read with the index's dtype, never as nanoGPT's. nanoGPT's
``.bin`` is the ids alone, uint16 (``data.dtype`` says uint32 for a larger vocabulary).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
         8: np.uint16}
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
MAX_SCAN = 64 << 20  # tokens whose largest id is found by reading them all (beyond: the first this many)


@dataclass(frozen=True)
class Index:
    dtype: type
    sizes: np.ndarray      # tokens of each sequence
    pointers: np.ndarray   # byte offset of each sequence in the .bin
    documents: np.ndarray  # sequence index where each document starts (and the end)


def read_index(path: Path) -> Index:
    """A Megatron ``.idx``; ValueError naming the file and what is wrong."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
    if len(head) < 34 or head[:9] != MAGIC:
        raise ValueError(f"{path}: not a Megatron-LM index (no {MAGIC!r} header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
    if version != 1:
        raise ValueError(f"{path}: Megatron-LM index version {version}; raytp reads version 1")
    if code not in CODES or not np.issubdtype(CODES[code], np.integer):
        raise ValueError(f"{path}: dtype code {code} is not an integer token id type")
    data = np.memmap(path, mode="r", offset=34)
    need = n_seq * 4 + n_seq * 8 + n_doc * 8
    if len(data) < need:
        raise ValueError(f"{path}: truncated ({34 + len(data)} bytes, its header needs {34 + need})")
    sizes = np.frombuffer(data, dtype=np.int32, count=n_seq)
    pointers = np.frombuffer(data, dtype=np.int64, count=n_seq, offset=n_seq * 4)
    documents = np.frombuffer(data, dtype=np.int64, count=n_doc, offset=n_seq * 12)
    if n_doc < 1 or documents[0] != 0 or documents[-1] != n_seq or (np.diff(documents) < 0).any():
        raise ValueError(f"{path}: its document boundaries do not run from sequence 0 to {n_seq}, in order")
    return Index(CODES[code], sizes, pointers, documents)


def index_bytes(sizes: np.ndarray, dtype) -> bytes:
    """A Megatron-LM .idx for documents of these lengths, one sequence per document (as preprocess_data.py
    writes it)."""
    code = {np.dtype(v): k for k, v in CODES.items()}[np.dtype(dtype)]
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    return (MAGIC + struct.pack("<QBQQ", 1, code, len(sizes), len(sizes) + 1) + sizes.tobytes()
            + (pointers * np.dtype(dtype).itemsize).tobytes() + np.arange(len(sizes) + 1, dtype=np.int64).tobytes())


def write_indexed(prefix: Path, documents: list[np.ndarray], dtype=np.int32) -> None:
    """Write documents (1-D id arrays) as a Megatron-LM indexed dataset ``prefix.bin`` + ``prefix.idx``, one
    sequence per document, as preprocess_data.py does (the index written last)."""
    with open(f"{prefix}.bin", "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(index_bytes(np.array([len(d) for d in documents]), dtype))


def open_tokens(path: Path, dtype: str | None) -> tuple[np.ndarray, str]:
    """The ids of a ``.bin`` (memory-mapped) and what they are: Megatron's when an ``.idx`` is beside it (its
    dtype; a `dtype` the job names that differs is refused), else nanoGPT's ids of `dtype` (uint16 default)."""
    idx = path.with_suffix(".idx")
    if idx.exists():
        index = read_index(idx)
        named = np.dtype(index.dtype).name
        if dtype is not None and dtype != named:
            raise ValueError(f"data.dtype: {dtype}, but {path} has a Megatron-LM index beside it ({idx.name}) "
                             f"that says its ids are {named}; drop data.dtype (the index decides)")
        tokens = np.memmap(path, dtype=index.dtype, mode="r")
        if len(tokens) != int(index.sizes.sum(dtype=np.int64)):
            raise ValueError(f"{path}: holds {len(tokens):,} {named} ids, its index {idx.name} "
                             f"{int(index.sizes.sum(dtype=np.int64)):,}")
        return tokens, f"Megatron-LM indexed dataset {path} ({named}, {len(index.sizes):,} documents)"
    kind = dtype or "uint16"
    size = path.stat().st_size
    if size % np.dtype(DTYPES[kind]).itemsize:
        raise ValueError(f"{path} is {size} bytes, not a whole number of {kind} ids (data.dtype)")
    return np.memmap(path, dtype=DTYPES[kind], mode="r"), f"{kind} ids in {path} (nanoGPT)"


def largest_id(*arrays: np.ndarray) -> int:
    """The largest id of the arrays (of their first MAX_SCAN ids each: a corpus of billions is not read whole
    where it is only opened)."""
    return max((int(a[:MAX_SCAN].max()) for a in arrays if len(a)), default=0)
