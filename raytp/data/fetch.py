"""A prepared dataset at a URL (``s3://...``, ``gs://...``), fetched once per node into the local cache.

Workers memory-map shards; an object store cannot be mapped, so the first worker of a node to open the dataset
copies it to ``$RAYTP_CACHE/datasets/<hash of the URL>/`` while the others on that node wait on a file lock,
then all map the same files (one copy per node, shared through the page cache). Each shard is copied under a
temporary name and renamed, and the manifest is copied last: a copy cut short is resumed shard by shard, never
mistaken for whole. A cached copy whose manifest differs from the URL's (the dataset was prepared again) is
replaced. In a run, the launcher has each node copy the job's datasets in a task of its own before any worker
starts there, for as long as the copy takes (raytp.runtime.cluster.data_copy); a worker then finds its node's
copy made.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

from raytp.data import manifest as mf
from raytp.data.tokens import cache_dir
from raytp.files.storage import Storage, StorageError

COPIERS = 8  # shard files copied at once


def is_url(name: str) -> bool:
    """Whether a data source names a URL (an object store's) rather than a local path."""
    return "://" in name and not name.startswith("file://")


def remote_manifest(url: str) -> mf.Manifest:
    return mf.parse(_read_manifest_text(Storage(url), url), f"{url}/{mf.NAME}")


def _read_manifest_text(store: Storage, url: str) -> str:
    try:
        if not store.exists(mf.NAME):
            raise ValueError(f"{url}: no {mf.NAME} (not a prepared dataset, or its `raytp prepare` did not finish)")
        return store.read_bytes(mf.NAME).decode("utf-8")
    except (OSError, StorageError) as e:
        raise ValueError(f"{url}: cannot read ({type(e).__name__}: {e})") from None


def local_dataset(url: str, progress: bool = False) -> Path:
    """The node-local copy of the prepared dataset at `url`, made if missing."""
    store = Storage(url)
    text = _read_manifest_text(store, url)
    m = mf.parse(text, f"{url}/{mf.NAME}")
    root = cache_dir() / "datasets" / hashlib.sha256(url.encode()).hexdigest()[:20]
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one copier per node; the others find it done
        have, copying = root / mf.NAME, root / ".copying"  # the manifest of a copy under way
        if have.exists() and have.read_text(encoding="utf-8") == text:
            return root
        started = copying.read_text(encoding="utf-8") if copying.exists() else None
        if have.exists() or (started is not None and started != text):
            have.unlink(missing_ok=True)  # another version of the dataset: its shards are copied again
            for p in root.glob("shard-*"):
                p.unlink()
        copying.write_text(text, encoding="utf-8")  # a copy cut short resumes only for this version
        try:
            _copy_shards(store, m, root, progress)
        except (OSError, StorageError) as e:
            raise ValueError(f"{url}: cannot copy the dataset to {root} ({type(e).__name__}: {e})") from None
        tmp = root / f".{mf.NAME}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, have)
        copying.unlink()
    return root


def _copy_shards(store: Storage, m: mf.Manifest, root: Path, progress: bool) -> None:
    """Each shard's files copied (COPIERS at a time: an object store serves many requests at once), each
    under a temporary name then renamed; those already whole (their size) are kept."""
    from concurrent.futures import ThreadPoolExecutor
    from tqdm import tqdm
    need = m.tokens * (2 if m.dtype == "uint16" else 4) + m.documents * 20  # the .bin ids and the .idx
    free = shutil.disk_usage(root).free
    if need > free:
        raise ValueError(f"the node has {free / 2**30:,.1f} GiB free at {root}, the dataset needs "
                         f"{need / 2**30:,.1f} GiB (set RAYTP_CACHE to a larger disk)")
    suffixes = (".idx", ".bin", ".mask") if m.conversations is not None else (".idx", ".bin")  # .mask: trained
    files = [f"{s.prefix}{suffix}" for s in m.shards for suffix in suffixes]

    def copy(rel: str) -> None:
        dest = root / rel
        if not dest.exists() or dest.stat().st_size != store.size(rel):
            tmp = dest.with_name(f".{dest.name}.tmp")
            with store.fs.open(store.path(rel), "rb") as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 16 << 20)
            os.replace(tmp, dest)

    with tqdm(total=len(files), desc="[raytp] fetching dataset", unit="file", disable=not progress,
              leave=False) as bar, ThreadPoolExecutor(COPIERS) as pool:
        for _ in pool.map(copy, files):
            bar.update(1)


def urls_of(data) -> list[str]:
    """The datasets at URLs a job's `data` section (raytp.config.schema.DataConfig) reads, each once, in order:
    data.source (or data.mix's sources), then data.val_source."""
    names = list(data.mix) if data.mix else [data.source]
    names += [data.val_source] if data.val_source else []
    return list(dict.fromkeys(n for n in names if n and is_url(n)))
