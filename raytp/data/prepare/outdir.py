"""The output directory of `raytp prepare`: what a run does with what it finds there.

A directory raytp prepare makes holds MARKER (written first: the fingerprint of what it is made from) and,
once finished, the manifest (written last). So:

    missing or empty                                  -> start
    no marker, not empty                              -> refused: not raytp's (nothing of it is removed)
    marker, no manifest (a killed or failed run)      -> start over (its files removed)
    marker and manifest, the same fingerprint         -> done: nothing to do
    marker and manifest, another fingerprint          -> refused, unless --overwrite (then start over)
"""
from __future__ import annotations

import json

from raytp.data import manifest
from raytp.files.storage import Storage

MARKER = ".raytp-prepare"
START, DONE, START_OVER = "start", "done", "start over"


def decide(names: list[str], marker: str | None, fingerprint: str, overwrite: bool, where: str) -> str:
    """What to do with an output directory holding `names`, whose marker records `marker` (None: no
    marker); ValueError when it must be left alone."""
    if not names:
        return START
    if marker is None:
        raise ValueError(f"--out: {where} is not empty and not a dataset raytp prepare made (no {MARKER}); "
                         "choose a new or empty directory")
    if manifest.NAME not in names:
        return START_OVER
    if marker == fingerprint:
        return DONE
    if overwrite:
        return START_OVER
    raise ValueError(f"--out: {where} holds a dataset prepared from other inputs or another tokenizer; "
                     "pass --overwrite to replace it, or choose another directory")


def _marker(store: Storage) -> str | None:
    try:
        return json.loads(store.read_bytes(MARKER))["fingerprint"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return ""  # ours, but unreadable (a kill while writing it): never equal to a fingerprint


def open_out(store: Storage, fingerprint: str, sources: list[str], overwrite: bool) -> str:
    """Make the output directory ready (cleared and marked when starting); what `decide` said."""
    names = store.listdir()
    what = decide(names, _marker(store) if MARKER in names else None, fingerprint, overwrite, store.url)
    if what == DONE:
        return what
    if what == START_OVER:
        store.remove(manifest.NAME)  # first: from here on it is not a dataset
        for name in names:
            if name not in (manifest.NAME, MARKER):
                store.remove(name)
    store.makedirs()
    store.write_bytes(MARKER, json.dumps({"fingerprint": fingerprint, "sources": sources}).encode())
    return what


def existing(store: Storage) -> manifest.Manifest:
    return manifest.parse(store.read_bytes(manifest.NAME).decode(), f"{store.url}/{manifest.NAME}")


def finish(store: Storage, m: manifest.Manifest) -> None:
    """Write the manifest: the dataset is whole from here on."""
    store.write_bytes(manifest.NAME, m.to_json().encode())
