"""One data source opened as token streams: what each `data.source` (and `data.mix` entry, and
`data.val_source`) can name, memory-mapped, never read whole into memory.

- ``builtin``: the Python standard library's source text on this machine, byte level (vocabulary 256).
- a directory of text files (``.txt .py .md .rst``): byte level, or with ``data.tokenizer`` prepared once
  into a raytp prepared dataset in the cache (raytp.data.prepare's in-process path).
- a raytp prepared dataset (``raytp prepare``'s output: a directory or URL holding ``manifest.json``); one
  at a URL is fetched once per node into the cache (raytp.data.fetch).
- a ``.bin``: a Megatron-LM indexed dataset when its ``.idx`` is beside it, else nanoGPT's ids (uint16, or
  ``data.dtype``); ``val.bin`` beside ``train.bin`` is the validation split.

Validation is a fraction of each source's whole documents, spread over its files and over each file
(raytp.data.stream.held_per_file, hold_out); a source with too few documents, or without document boundaries
(nanoGPT's ``.bin``, the builtin text) holds out its tail.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raytp.trust import inside
from raytp.data import manifest as mf
from raytp.data.conversation_split import Documents, Splitter
from raytp.data.fetch import is_url, local_dataset, remote_manifest
from raytp.data.indexed import largest_id, open_tokens, read_index
from raytp.data.stream import Stream, held_per_file, hold_out, tail
from raytp.data.tokens import cache_dir

BUILTIN_MAX_BYTES = 8 << 20  # enough text for small models; reads in well under a second
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")


@dataclass
class Source:
    train: Stream | None   # None: only looked at (`peek`), not opened
    val: Stream | None     # the held-out documents; everything is `train` when nothing was held out
    vocab_size: int        # ids are below this
    eod_id: int | None     # the end-of-document id, when the source knows it
    description: str
    tokenizer: str | None = None  # the sha256 of the tokenizer a prepared dataset was made with
    documents: Documents | None = None  # conversations: their boundaries and trained masks (None: peeked at)
    conversations: dict | None = None   # conversations: the manifest's counts (rows, trained_tokens, bad)


def open_source(name: str, val_fraction: float | None, tokenizer: str | None = None, dtype: str | None = None,
                progress: bool = False, peek: bool = False) -> Source:
    """The source a job names (`val_fraction` None: hold nothing out); `peek`: a source at a URL is described
    from its manifest without fetching its shards. ValueError naming the problem."""
    if is_url(name):
        if peek:
            m = remote_manifest(name)
            return Source(None, None, m.vocab_size, m.eod_id, _describe(name, m), m.tokenizer.get("sha256"),
                          None, m.conversations)
        return _prepared(local_dataset(name, progress), val_fraction, name)
    path = Path(name.removeprefix("file://")).expanduser()
    if name != "builtin" and not path.exists():
        raise ValueError(f"{name} does not exist (use 'builtin', a directory of text, a prepared dataset, "
                         "or a .bin file)")
    if path.is_dir() and (path / mf.NAME).exists():
        return _prepared(path, val_fraction, name)
    if tokenizer is not None and (name == "builtin" or path.is_dir()):
        return _tokenized(name, path, val_fraction, tokenizer, progress)
    if name == "builtin":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        tokens = _builtin_bytes(stdlib)
        return _split(tokens, np.array([len(tokens)]), val_fraction, 256, None,
                      f"builtin: Python stdlib source at {stdlib} ({len(tokens):,} bytes)")
    if path.is_dir():
        if any(path.glob("*.bin")) or any(path.glob("*.idx")):
            raise ValueError(f"{name}: a directory of .bin/.idx files without a {mf.NAME}: name one .bin "
                             "(a Megatron-LM or nanoGPT file), or prepare the corpus with `raytp prepare`")
        files = text_files(path)
        if not any(p.stat().st_size for p in files):
            raise ValueError(f"the {len(files)} text files under {path} are empty")
        tokens, ends = _bytes_of(files)
        return _split(tokens, ends, val_fraction, 256, None, f"{len(files)} text files under {path} "
                      f"({len(tokens):,} bytes)")
    if path.suffix == ".bin":
        return _bin(path, val_fraction, dtype)
    raise ValueError(f"{name} is neither a directory, a prepared dataset, nor a .bin file of token ids")


def text_files(path: Path) -> list[Path]:
    files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
                   and ".raytp" not in p.parts)
    if not files:
        raise ValueError(f"no {'/'.join(TEXT_SUFFIXES)} files under {path}")
    return files


def _split(tokens: np.ndarray, doc_ends: np.ndarray, val_fraction: float | None, vocab: int, eod: int | None,
           what: str) -> Source:
    """A source of one file: validation held out by whole documents (raytp.data.stream), or by its tail."""
    if val_fraction is None:
        return Source(Stream([tokens]), None, vocab, eod, what)
    held = held_per_file([len(doc_ends)], val_fraction)
    if held is None:
        cut = tail(len(tokens), val_fraction)
        train, val = [(0, cut)], [(cut, len(tokens))]
    else:
        train, val = hold_out(doc_ends, held[0])
    return Source(Stream.of(tokens, train), Stream.of(tokens, val), vocab, eod, what)


def _describe(name: str, m: mf.Manifest) -> str:
    what = (f"prepared dataset {name} ({m.tokens:,} tokens, {m.documents:,} documents in {len(m.shards)} "
            f"shards, vocabulary {m.vocab_size:,})")
    if m.conversations is not None:  # the start line says what is trained on and what was left out, by reason
        c = m.conversations
        bad = ", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in c["bad"].items() if n)
        what += (f", conversations: {c['trained_tokens']:,} tokens trained on, {sum(c['bad'].values()):,} of "
                 f"{c['rows']:,} rows left out" + (f" ({bad})" if bad else ""))
    return what


def read_manifest(path: Path, name: str) -> mf.Manifest:
    return mf.parse(inside(path, mf.NAME, name).read_text(encoding="utf-8"), f"{name}/{mf.NAME}")


def _prepared(path: Path, val_fraction: float | None, name: str) -> Source:
    m = read_manifest(path, name)
    _open_files_for(len(m.shards), name)
    held = None if val_fraction is None else held_per_file([s.documents for s in m.shards], val_fraction)
    conv = Splitter() if m.conversations is not None else None
    train, val = [], []
    for i, shard in enumerate(m.shards):
        tokens, ends = _shard(path, shard, name)
        if held is not None:
            t, v = hold_out(ends, held[i])
        elif val_fraction is not None and i == len(m.shards) - 1 and not conv:  # too few documents: the tail
            cut = max(len(tokens) - (m.tokens - tail(m.tokens, val_fraction)), 1)
            t, v = [(0, cut)], [(cut, len(tokens))]
        else:
            t, v = [(0, len(tokens))], []
        train += [tokens[a:b] for a, b in t]
        val += [tokens[a:b] for a, b in v]
        if conv is not None:
            conv.add(path, shard, len(tokens), ends, t, v, name)
    docs = None if conv is None else conv.documents(val_fraction is not None)
    return Source(Stream(train), Stream(val) if val_fraction is not None else None, m.vocab_size, m.eod_id,
                  _describe(name, m), m.tokenizer.get("sha256"), docs, m.conversations)


def _shard(path: Path, shard: mf.Shard, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A shard's ids (memory-mapped) and its documents' end offsets, checked against the manifest."""
    where = f"{name}/{mf.NAME}: shards"  # the manifest's names lead to files of the dataset only
    bin_path, idx_path = (inside(path, f"{shard.prefix}{suffix}", where) for suffix in (".bin", ".idx"))
    for p in (bin_path, idx_path):
        if not p.exists():
            raise ValueError(f"{name}: {p.name} is missing (the manifest lists {shard.prefix})")
    tokens, _ = open_tokens(bin_path, None)
    ends = _doc_ends(idx_path)
    if len(tokens) != shard.tokens or len(ends) != shard.documents:
        raise ValueError(f"{name}: {shard.prefix} holds {len(tokens):,} tokens in {len(ends):,} documents, "
                         f"the manifest says {shard.tokens:,} in {shard.documents:,}")
    return tokens, ends


def _open_files_for(shards: int, name: str, spare: int = 1024) -> None:
    """Each mapped shard holds a file descriptor: raise this process's soft limit of open files (up to its hard
    limit) to hold them all, or say what to do."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = shards + spare
    if need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise ValueError(f"{name}: {shards:,} shards to map, but a process here may open {hard:,} files (ulimit "
                         f"-Hn); raise it, or prepare the corpus again with a larger --shard-tokens")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _doc_ends(idx: Path) -> np.ndarray:
    """Each document's end offset (in tokens) in the .bin of a Megatron-LM index."""
    index = read_index(idx)
    seq_ends = np.cumsum(index.sizes, dtype=np.int64)
    return seq_ends[index.documents[1:] - 1] if len(index.documents) > 1 else seq_ends[-1:]


def _bin(path: Path, val_fraction: float | None, dtype: str | None) -> Source:
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty: no token ids")
    tokens, what = open_tokens(path, dtype)
    idx = path.with_suffix(".idx")
    vocab = largest_id(tokens) + 1
    if idx.exists():
        return _split(tokens, _doc_ends(idx), val_fraction, vocab, None, f"{what}: {len(tokens):,} tokens")
    val_path = path.with_name("val.bin")
    if path.name == "train.bin" and val_path.exists() and val_fraction is not None:
        val = open_tokens(val_path, dtype)[0]
        return Source(Stream([tokens]), Stream([val]), max(vocab, largest_id(val) + 1), None,
                      f"{what} and {val_path.name}: {len(tokens):,} + {len(val):,} tokens")
    return _split(tokens, np.array([len(tokens)]), val_fraction, vocab, None, f"{what}: {len(tokens):,} tokens")


def builtin_files(stdlib: Path) -> list[Path]:
    files = sorted(stdlib.glob("*.py"))  # top level first: stable across installs of one version
    return files + sorted(p for p in stdlib.glob("*/*.py")
                          if not p.parts[-2].startswith(("test", "site-packages", "idlelib")))


def _cached(name: str, write) -> Path:
    """A file of the cache, made by `write(path)` if missing (written elsewhere, then renamed: concurrent
    workers never read half a file)."""
    path = cache_dir() / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{name}.{os.getpid()}")
        write(tmp)
        os.replace(tmp, path)
    return path


def _write_bytes(files: list[Path], limit: int | None, out: Path) -> list[int]:
    """The files' bytes, joined by newlines (at most `limit` bytes), streamed to `out`; each one's end offset."""
    ends, total = [], 0
    with open(out, "wb") as f:
        for p in files:
            data = p.read_bytes() + b"\n"
            if limit is not None:
                data = data[:limit - total]
            f.write(data)
            total += len(data)
            ends.append(total)
            if limit is not None and total >= limit:
                break
    return ends


def _builtin_bytes(stdlib: Path) -> np.ndarray:
    """The stdlib's source as bytes, cached as one file (memory-mapped) so that a worker starts fast."""
    name = f"builtin-{sys.version_info.major}.{sys.version_info.minor}-{BUILTIN_MAX_BYTES}.u8"
    path = _cached(name, lambda tmp: _write_bytes(builtin_files(stdlib), BUILTIN_MAX_BYTES, tmp))
    return np.memmap(path, dtype=np.uint8, mode="r")


def _bytes_of(files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """A directory's text as bytes (each file a document), cached by the files' names, sizes and times."""
    ends = np.cumsum([p.stat().st_size + 1 for p in files], dtype=np.int64)
    path = _cached(f"text-{files_key(files)}.u8", lambda tmp: _write_bytes(files, None, tmp))
    tokens = np.memmap(path, dtype=np.uint8, mode="r")
    if len(tokens) != ends[-1]:  # a file that changed size while this ran
        raise ValueError(f"the text files under {files[0].parent} changed while they were read; run again")
    return tokens, ends


def files_key(files: list[Path]) -> str:
    """A name for what `files` hold now (their paths, sizes and modification times)."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _tokenized(name: str, path: Path, val_fraction: float | None, tokenizer: str, progress: bool) -> Source:
    """A text source with a tokenizer: prepared once (raytp.data.prepare, in this process) into a prepared
    dataset named by what the tokenizer and the files are, beside the data if writable, else in the cache;
    processes on one node that open it together wait for the first to make it (a file lock)."""
    from raytp.data.prepare import prepare_local
    from raytp.data.tokens import tokenizer_file
    if name == "builtin":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files, near, what = _up_to(builtin_files(stdlib), BUILTIN_MAX_BYTES), None, f"builtin: Python stdlib at {stdlib}"
    else:
        files = text_files(path)
        near, what = path, f"{len(files)} text files under {path}"
    tok_path = tokenizer_file(tokenizer)
    key = hashlib.sha256(tok_path.read_bytes() + files_key(files).encode()).hexdigest()[:20]
    out = _place(near, f"prepared-{key}")
    with open(out.with_name(f".{out.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / mf.NAME).exists():
            prepare_local(files, tokenizer, str(out), overwrite=True, progress=progress)
    source = _prepared(out, val_fraction, str(out))
    source.description = f"{what}, {len(source.train) + len(source.val or ()):,} tokens of {tokenizer} (at {out})"
    return source


def _up_to(files: list[Path], limit: int) -> list[Path]:
    """The first files holding about `limit` bytes (whole files)."""
    out, total = [], 0
    for f in files:
        if total >= limit:
            break
        out.append(f)
        total += f.stat().st_size
    return out


def _place(near: Path | None, name: str) -> Path:
    """Where a prepared text source goes: beside the data (``<dir>/.raytp/``) if writable, else the cache."""
    if near is not None:
        d = near / ".raytp"
        try:
            d.mkdir(exist_ok=True)
            if os.access(d, os.W_OK):
                return d / name
        except OSError:
            pass
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d / name
