"""Text to token ids with a Hugging Face tokenizer (the `tokenizers` library), done once and cached.

``data.tokenizer`` names a ``tokenizer.json`` (or a directory holding one,
such as a model.init_from directory). A text source (builtin, or a directory
of text files) is then encoded once, document by document, into a flat file
of token ids, memory-mapped by every worker that reads it: beside the data
(``<dir>/.raytp/``) when that directory is writable, else in the cache
(``$RAYTP_CACHE``, default ~/.cache/raytp). Its name is a hash of the
tokenizer and of the source's files (names, sizes, modification times), so an
edit to either makes a new one; it is written whole under another name and
renamed, so concurrent readers never see half of it. Ids are stored as uint16
when the vocabulary fits, else uint32 (Llama 3's 128k tokens).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

ENCODE_BATCH = 64  # documents per encode_batch call (the library spreads a batch over its threads)


def tokenizer_file(spec: str, key: str = "data.tokenizer") -> Path:
    """The tokenizer.json that `spec` (a file, or a directory holding one) names; ValueError naming `key`
    (where the user gave it) if none."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{key}: {spec}: no such tokenizer.json (give a Hugging Face tokenizer.json "
                         "or a directory that holds one)")
    return path


def load(spec: str, key: str = "data.tokenizer"):
    """The tokenizers.Tokenizer of `spec`; ValueError naming the file if it cannot be read."""
    from tokenizers import Tokenizer
    path = tokenizer_file(spec, key)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on a malformed file
        raise ValueError(f"{key}: {path}: not a Hugging Face tokenizer.json ({e})") from None


def from_json(text: str):
    from tokenizers import Tokenizer
    return Tokenizer.from_str(text)


def _dtype(vocab: int):
    return np.uint16 if vocab <= 1 << 16 else np.uint32


def cache_key(tokenizer_path: Path, files: list[Path], limit: int | None) -> str:
    h = hashlib.sha256(tokenizer_path.read_bytes())
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(str(limit).encode())
    return h.hexdigest()[:20]


def _place(near: Path | None, name: str) -> Path:
    """Where the token file goes: beside the data if writable, else the cache."""
    if near is not None:
        d = near / ".raytp"
        try:
            d.mkdir(exist_ok=True)
            if os.access(d, os.W_OK):
                return d / name
        except OSError:
            pass
    cache = Path(os.environ.get("RAYTP_CACHE", Path.home() / ".cache" / "raytp"))
    cache.mkdir(parents=True, exist_ok=True)
    return cache / name


def tokenized(spec: str, files: list[Path], near: Path | None, limit: int | None = None,
              progress: bool = False) -> tuple[np.ndarray, int, str]:
    """(token ids, vocabulary size, where they are) of `files` (documents, joined by a newline as the
    byte-level reader joins them; at most `limit` bytes of text when given), memory-mapped from the
    cached token file, which is made first if missing (with a progress bar when `progress`)."""
    tok_path = tokenizer_file(spec)
    tok = load(spec)
    vocab = tok.get_vocab_size()
    dtype = _dtype(vocab)
    name = f"tokens-{cache_key(tok_path, files, limit)}.{np.dtype(dtype).name}"
    path = _place(near, name)
    if not path.exists():
        _encode_to(tok, files, limit, path, dtype, progress)
    return np.memmap(path, dtype=dtype, mode="r"), vocab, str(path)


def _documents(files: list[Path], limit: int | None):
    total = 0
    for f in files:
        data = f.read_bytes()
        if limit is not None and total + len(data) > limit:
            data = data[:max(limit - total, 0)]
        total += len(data) + 1
        yield f, data.decode("utf-8", errors="replace") + "\n"
        if limit is not None and total >= limit:
            return


def _encode_to(tok, files, limit, path: Path, dtype, progress: bool) -> None:
    from tqdm import tqdm
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    size = sum(f.stat().st_size for f in files) if limit is None else min(limit, sum(f.stat().st_size for f in files))
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="[raytp] tokenizing", disable=not progress,
               leave=False)
    count = 0
    with open(tmp, "wb") as out:
        batch: list[str] = []

        def flush():
            nonlocal count
            for enc in tok.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray(enc.ids, dtype=dtype)
                ids.tofile(out)
                count += len(ids)
            bar.update(sum(len(d.encode()) for d in batch))
            batch.clear()
        for _, text in _documents(files, limit):
            batch.append(text)
            if len(batch) == ENCODE_BATCH:
                flush()
        if batch:
            flush()
    bar.close()
    if count == 0:
        tmp.unlink()
        raise ValueError("data.source: the text encodes to no tokens")
    os.replace(tmp, path)
