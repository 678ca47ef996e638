"""Corpora and deterministic batches.

The batch of step s for DP rank d is a pure function of (seed, s, d): the
global batch's sequence offsets are drawn from a generator seeded by
(seed, split, s), and DP rank d takes its contiguous rows. The global batch
does not depend on the DP degree, so every layout sees the same data, and
any step can be replayed exactly (recovery, resizing).

Sources:
- ``builtin``: the Python standard library's own source text on this machine
  (no download), byte-level tokens, vocabulary 256.
- a directory: every ``*.txt``/``*.py``/``*.md`` file under it, byte level.
- a ``.bin`` file of token ids, memory-mapped (raytp.data.indexed):
  Megatron-LM's indexed dataset when its ``.idx`` is beside it (the index's
  id type), else nanoGPT's format (uint16, or ``data.dtype``); a ``val.bin``
  beside a ``train.bin`` is used for validation. The largest id is found in
  the first 64M ids of each split.
With ``data.tokenizer`` set, the text sources are encoded by that Hugging Face
tokenizer instead of taken as bytes (once, cached: raytp.train.tokens).
"""
from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from raytp.seeds import derive_seed
from raytp.data.indexed import largest_id, open_tokens

BUILTIN_MAX_BYTES = 8 << 20  # enough text for small models; reads in well under a second
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")


@dataclass
class Corpus:
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    vocab_size: int
    description: str


def _read_text_files(files: list[Path], max_bytes: int | None) -> np.ndarray:
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return np.frombuffer(b"\n".join(chunks)[:max_bytes], dtype=np.uint8)


def _builtin_files(stdlib: Path) -> list[Path]:
    files = sorted(stdlib.glob("*.py"))  # top level first: stable across installs of one version
    return files + sorted(p for p in stdlib.glob("*/*.py")
                          if not p.parts[-2].startswith(("test", "site-packages", "idlelib")))


def _builtin_tokens(stdlib: Path) -> np.ndarray:
    """The stdlib's source as bytes; cached as one file (memory-mapped) so that a worker starts fast."""
    cache = Path(os.environ.get("RAYTP_CACHE", Path.home() / ".cache" / "raytp"))
    name = f"builtin-{sys.version_info.major}.{sys.version_info.minor}-{BUILTIN_MAX_BYTES}.u8"
    path = cache / name
    if path.exists():
        return np.memmap(path, dtype=np.uint8, mode="r")
    tokens = _read_text_files(_builtin_files(stdlib), BUILTIN_MAX_BYTES)
    try:  # written whole elsewhere, then renamed: concurrent workers never read half a file
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{name}.{os.getpid()}"
        tokens.tofile(tmp)
        os.replace(tmp, path)
    except OSError:
        pass  # no cache: read again next time
    return tokens


def _split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(int(len(tokens) * val_fraction), 1)
    return tokens[:-n_val], tokens[-n_val:]


def load_corpus(source: str, val_fraction: float = 0.1, tokenizer: str | None = None,
                progress: bool = False, dtype: str | None = None) -> Corpus:
    """Load a corpus named by a job's `data.source` (text encoded by `tokenizer`, a job's data.tokenizer,
    when given; `progress`: show a progress bar if it must be encoded now; `dtype`: data.dtype, of a nanoGPT
    .bin's ids); raises ValueError naming the problem."""
    if tokenizer is not None and (source == "builtin" or Path(source).expanduser().is_dir()):
        return _tokenized_corpus(source, val_fraction, tokenizer, progress)
    if source == "builtin":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        tokens = _builtin_tokens(stdlib)
        train, val = _split(tokens, val_fraction)
        return Corpus(train, val, 256, f"builtin: Python stdlib source at {stdlib} ({len(tokens):,} bytes)")
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"data.source: {source} does not exist (use 'builtin', a directory of text, or a .bin file)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"data.source: no {'/'.join(TEXT_SUFFIXES)} files under {path}")
        tokens = _read_text_files(files, None)
        train, val = _split(tokens, val_fraction)
        return Corpus(train, val, 256, f"{len(files)} text files under {path} ({len(tokens):,} bytes)")
    if path.suffix == ".bin":
        tokens, what = open_tokens(path, dtype)
        val_path = path.with_name("val.bin")
        if path.name == "train.bin" and val_path.exists():
            train, val = tokens, open_tokens(val_path, dtype)[0]
        else:
            train, val = _split(tokens, val_fraction)
        return Corpus(train, val, largest_id(train, val) + 1, f"{what}: {len(tokens):,} tokens")
    raise ValueError(f"data.source: {source} is neither a directory nor a .bin file of token ids")


def _tokenized_corpus(source: str, val_fraction: float, tokenizer: str, progress: bool) -> Corpus:
    from raytp.train import tokens as tok
    if source == "builtin":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files, near, limit, what = _builtin_files(stdlib), None, BUILTIN_MAX_BYTES, f"builtin: Python stdlib at {stdlib}"
    else:
        path = Path(source).expanduser()
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
                       and ".raytp" not in p.parts)
        if not files:
            raise ValueError(f"data.source: no {'/'.join(TEXT_SUFFIXES)} files under {path}")
        near, limit, what = path, None, f"{len(files)} text files under {path}"
    ids, vocab, where = tok.tokenized(tokenizer, files, near, limit, progress)
    train, val = _split(ids, val_fraction)
    return Corpus(train, val, vocab, f"{what}, {len(ids):,} tokens of {tokenizer} (cached at {where})")


SPLITS = {"train": 0, "val": 1}


def batch(corpus: Corpus, split: str, seed: int, step: int, dp_rank: int, dp: int,
          batch_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of shape (batch_size/dp, block_size): DP rank `dp_rank`'s rows of the global batch."""
    tokens = corpus.train if split == "train" else corpus.val
    if len(tokens) <= block_size + 1:
        raise ValueError(f"the {split} split has {len(tokens)} tokens, fewer than block_size+1={block_size + 1}")
    g = torch.Generator().manual_seed(derive_seed(seed, SPLITS[split], step))
    offsets = torch.randint(len(tokens) - block_size - 1, (batch_size,), generator=g)
    per = batch_size // dp
    rows = np.stack([np.asarray(tokens[o:o + block_size + 1], dtype=np.int64)
                     for o in offsets[dp_rank * per:(dp_rank + 1) * per].tolist()])
    rows = torch.from_numpy(rows)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
