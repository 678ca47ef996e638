"""Where checkpoints live: a local or shared-filesystem path, or an object store, through fsspec.

``checkpoint.dir`` is a path (``/mnt/shared/ckpt``, ``runs/x/checkpoints``) or a
URL fsspec knows (``s3://bucket/prefix``, ``gs://...``, ``file:///...``), as Ray
Train's ``storage_path`` is. Every worker opens the same location and writes its
own shard files there; the driver writes the manifest last. Credentials and
endpoints come from the usual environment (``AWS_*``, ``AWS_ENDPOINT_URL``, ...).

A ``Storage`` is small and picklable (its URL), so it travels to the workers. On
a filesystem a checkpoint is written into a hidden temporary directory and
renamed into place (atomic); an object store has no rename, so a checkpoint is
written in place and is whole once its manifest exists (readers skip a
directory without one).
"""
from __future__ import annotations

import os
import posixpath
from pathlib import Path


class StorageError(RuntimeError):
    """A checkpoint location that cannot be used (unknown scheme, missing library, not writable)."""


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


class Storage:
    def __init__(self, url: str | Path):
        self.url = str(url)
        self.scheme = _scheme(self.url)
        if self.scheme == "file" and "://" not in self.url:
            self.url = os.path.abspath(os.path.expanduser(self.url))  # the same place seen from every process
        self._fs = None
        self.root = None

    def __reduce__(self):
        return Storage, (self.url,)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    @property
    def fs(self):
        if self._fs is None:
            import fsspec
            try:
                self._fs, root = fsspec.core.url_to_fs(self.url)
            except (ImportError, ValueError) as e:  # a scheme fsspec does not know, or its library missing
                raise StorageError(f"{self.url}: {e}") from None
            self.root = root.rstrip("/") or root
        return self._fs

    @property
    def local(self) -> bool:
        """A filesystem path (shared or not): has atomic renames."""
        return self.scheme in ("file", "local")

    def path(self, *parts: str) -> str:
        self.fs  # noqa: B018 - resolves self.root
        return posixpath.join(self.root, *parts) if parts else self.root

    # -- reading ------------------------------------------------------------------------------------
    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def size(self, *parts: str) -> int:
        return int(self.fs.size(self.path(*parts)))

    def read_bytes(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        """`length` bytes of file `rel` from `start` (one ranged read on an object store)."""
        if length == 0:
            return b""
        if self.local:
            fd = os.open(self.path(rel), os.O_RDONLY)  # no buffered file object: a read is one system call
            try:
                return os.pread(fd, length, start)
            finally:
                os.close(fd)
        return self.fs.cat_file(self.path(rel), start=start, end=start + length)

    def read_into(self, rel: str, start: int, buf: memoryview) -> None:
        """Fill `buf` (a writable byte buffer) with the file's bytes from `start`: straight into it on a
        filesystem, through one ranged read elsewhere."""
        n = len(buf)
        if self.local:
            fd = os.open(self.path(rel), os.O_RDONLY)
            try:
                got = os.preadv(fd, [buf], start)
            finally:
                os.close(fd)
        else:
            data = self.read_range(rel, start, n)
            got = len(data)
            buf[:got] = data
        if got != n:
            raise EOFError(f"{self.url}/{rel}: {got} bytes at {start}, {n} expected (truncated?)")

    def listdir(self, *parts: str) -> list[str]:
        """Names directly under a directory ([] if it does not exist)."""
        where = self.path(*parts)
        try:
            entries = self.fs.ls(where, detail=False, refresh=True) if not self.local else os.listdir(where)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    # -- writing ------------------------------------------------------------------------------------
    def open_write(self, rel: str):
        """A binary file to write (streamed: an object store uploads it in parts as it goes)."""
        if self.local:
            os.makedirs(posixpath.dirname(self.path(rel)), exist_ok=True)
            return open(self.path(rel), "wb")
        return self.fs.open(self.path(rel), "wb")

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.open_write(rel) as f:
            f.write(data)
            if self.local:
                f.flush()
                os.fsync(f.fileno())

    def makedirs(self, *parts: str) -> None:
        if self.local:
            os.makedirs(self.path(*parts), exist_ok=True)

    def remove(self, *parts: str) -> None:
        """Remove a file or a directory tree; a missing one is fine."""
        where = self.path(*parts)
        try:
            if self.local:
                import shutil
                (shutil.rmtree if os.path.isdir(where) else os.remove)(where)
            else:
                self.fs.rm(where, recursive=True)
        except FileNotFoundError:
            pass

    def commit_dir(self, tmp: str, final: str) -> None:
        """Move a finished directory into place, atomically (filesystems only), durably."""
        src, dst = self.path(tmp), self.path(final)
        if os.path.exists(dst):  # a save of the same step: replace it whole
            import shutil
            shutil.rmtree(dst)
        fsync_path(src)
        os.rename(src, dst)
        fsync_path(self.path())


def checkpoint_location(cfg, run_dir, run: str) -> str:
    """Where a run's checkpoints go: checkpoint.dir, else under runtime.storage (<storage>/<run>/checkpoints:
    another machine resumes from there), else the run directory's checkpoints/."""
    if cfg.checkpoint.dir:
        return cfg.checkpoint.dir
    if cfg.runtime.storage:
        return f"{cfg.runtime.storage.rstrip('/')}/{run}/checkpoints"
    return str(Path(run_dir) / "checkpoints")


def fsync_path(path) -> None:
    """fsync a file or a directory (a directory: so that a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(storage: Storage, probe: str = ".raytp-probe") -> None:
    """Write, read back and remove a small file at the location; StorageError saying why it cannot. On a
    filesystem, directories it had to make for that are removed again (a check writes nothing)."""
    made = []
    if storage.local:
        at = storage.path()
        while at and not os.path.exists(at):
            made.append(at)
            at = os.path.dirname(at)
    try:
        storage.makedirs()
        storage.write_bytes(probe, b"raytp")
        if storage.read_bytes(probe) != b"raytp":
            raise StorageError(f"{storage.url}: a file written there reads back differently")
        storage.remove(probe)
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - permissions, credentials, an unreachable endpoint: all say "no"
        raise StorageError(f"{storage.url}: cannot write there ({type(e).__name__}: {e})") from None
    finally:
        for d in made:  # deepest first
            try:
                os.rmdir(d)
            except OSError:
                pass


def probe_name(token: str, rank: int | None = None) -> str:
    return f".raytp-probe-{token}" + (f"-{rank}" if rank is not None else "")


def answer_probe(storage: Storage, token: str, rank: int) -> str | None:
    """A worker's side of the check that it reaches the same location as the driver: it must read the
    driver's probe and write its own. None if it can, else why not."""
    try:
        if not storage.exists(probe_name(token)) or storage.read_bytes(probe_name(token)) != token.encode():
            return f"rank {rank} does not see the files the driver writes at {storage.url} (not a shared location?)"
        storage.write_bytes(probe_name(token, rank), token.encode())
    except Exception as e:  # noqa: BLE001 - credentials, permissions, network: all mean "cannot"
        return f"rank {rank} cannot write to {storage.url} ({type(e).__name__}: {e})"
    return None
