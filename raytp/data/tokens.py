"""Hugging Face tokenizers (the `tokenizers` library) as a job names them, and the cache text sources are
prepared into.

``data.tokenizer`` (and ``raytp prepare --tokenizer``, ``raytp sample --tokenizer``) names a ``tokenizer.json``
or a directory holding one, such as a model.init_from directory. A text source a job names with a tokenizer is
prepared once into a raytp prepared dataset (raytp.data.token_sources: beside the data when that directory is
writable, else in the cache, ``$RAYTP_CACHE``, default ~/.cache/raytp).
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("RAYTP_CACHE", Path.home() / ".cache" / "raytp"))


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
