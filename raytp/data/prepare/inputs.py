"""What `raytp prepare` reads: SOURCE arguments (a file, a directory, a glob, a URL) expanded to files, each
with its format, known by its name's suffix and never guessed.

    text     .txt .md .py .rst                  one document per file
    jsonl    .jsonl .json [.gz .zst .bz2]       one JSON object per line, the text under --text-key
    parquet  .parquet                           one row per document, the text in column --text-key

Paths and URLs go through fsspec as checkpoint directories do (raytp.files.storage): ``s3://bucket/corpus``,
``file:///data/x.jsonl``, ``/data/*.parquet``. A directory is every file under it (hidden ones skipped); a
file there of another format is an error naming it (a glob chooses among a directory's files).
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass

from raytp.files.storage import Storage

TEXT = (".txt", ".md", ".py", ".rst")
JSONL = (".jsonl", ".json")
PARQUET = (".parquet",)
COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2"}
GLOB = set("*?[")


@dataclass(frozen=True)
class File:
    url: str                 # as fsspec opens it (the scheme kept: s3://bucket/key, or a local path)
    kind: str                # text | jsonl | parquet
    size: int                # bytes on storage (compressed, for a compressed file)
    compression: str | None  # gzip | zstd | bz2 (jsonl only)
    version: str             # what changes when the file does: its modification time, else its ETag


def format_of(name: str) -> tuple[str, str | None]:
    """(kind, compression) of a file by its name; ValueError naming it if the suffix is not one raytp reads."""
    base = posixpath.basename(name).lower()
    stem, dot, ext = base.rpartition(".")
    compression = COMPRESSION.get(dot + ext) if dot else None
    if compression:
        stem, dot, ext = stem.rpartition(".")
    suffix = dot + ext if dot and stem else ""
    if suffix in JSONL:
        return "jsonl", compression
    if not compression and suffix in TEXT:
        return "text", None
    if not compression and suffix in PARQUET:
        return "parquet", None
    known = ", ".join(TEXT + JSONL + PARQUET) + " (JSON lines also .gz, .zst, .bz2)"
    raise ValueError(f"{name}: unknown format (suffix {posixpath.splitext(base)[1] or 'none'!r}); "
                     f"raytp prepare reads {known}")


def _join(scheme_url: str, path: str) -> str:
    """A path fsspec returned (no scheme), as a URL of the source's storage."""
    if "://" in scheme_url and not scheme_url.startswith("file://"):
        return f"{scheme_url.split('://', 1)[0]}://{path}"
    return path


def _version(info: dict) -> str:
    for key in ("mtime", "ETag", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def expand(source: str) -> list[File]:
    """The files of one SOURCE in name order; ValueError if it names none (an empty source) or one of an
    unknown format."""
    store = Storage(source)
    fs, root = store.fs, store.path()
    if GLOB & set(source):
        infos = {p: fs.info(p) for p in fs.glob(root)}
        infos = {p: i for p, i in infos.items() if i.get("type") != "directory"}
    elif fs.isdir(root):
        infos = fs.find(root, detail=True)
        infos = {p: i for p, i in infos.items()
                 if not any(part.startswith(".") for part in posixpath.relpath(p, root).split("/"))}
    elif fs.exists(root):
        infos = {root: fs.info(root)}
    else:
        raise ValueError(f"{source}: no such file or directory")
    if not infos:
        raise ValueError(f"{source}: an empty source (no files)")
    files = []
    for path in sorted(infos):
        kind, compression = format_of(_join(source, path))
        info = infos[path]
        files.append(File(_join(source, path), kind, int(info.get("size") or 0), compression, _version(info)))
    return files


def expand_all(sources: list[str]) -> list[File]:
    """The files of every SOURCE, in the order given (each source's in name order), each once."""
    if not sources:
        raise ValueError("no SOURCE given (files, directories, globs or URLs of a corpus)")
    seen, files = set(), []
    for source in sources:
        for f in expand(str(source)):
            if f.url not in seen:
                seen.add(f.url)
                files.append(f)
    return files
