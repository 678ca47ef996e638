"""safetensors files written tensor by tensor and read by byte range, over a Storage.

The format (https://huggingface.co/docs/safetensors): 8 bytes of little-endian
header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}``, then the raw little-endian data.
No pickle anywhere. Writing needs only each tensor's dtype and shape up front,
so a file is streamed one tensor at a time (the writer never holds more than
one); reading parses the header once, holds it to the format (raytp.trust.check_header: every tensor's
bytes dtype x shape long, inside the data section, no gap, no overlap) and fetches only the rows asked
for, inside the tensor's own bytes: one ranged read for a run of rows, one per row for a block of columns.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Callable, Iterable

import torch

from raytp import trust

DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
TORCH = {v: k for k, v in DTYPES.items()}


class FormatError(ValueError):
    """Not a readable safetensors file (truncated, corrupt, or not one at all)."""


def header_bytes(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the JSON header (padded to 8 bytes) for tensors in this order."""
    head: dict = {"__metadata__": metadata}
    at = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        head[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write(f, items: Iterable[tuple[str, torch.dtype, tuple[int, ...], Callable]],
          metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file to the binary file `f`: items are (name, dtype, shape, produce), and
    produce() is called when its tensor's turn comes: a CPU tensor of that dtype and shape, or an
    iterable of tensors whose bytes, one after the other, are that tensor's (chunks of a transpose).
    Bytes written."""
    items = list(items)
    head = header_bytes([(n, d, s) for n, d, s, _ in items], metadata or {})
    f.write(head)
    total = len(head)
    for name, dtype, shape, produce in items:
        out = produce()
        if isinstance(out, torch.Tensor) and (out.dtype != dtype or tuple(out.shape) != tuple(shape)):
            raise ValueError(f"{name}: produced {out.dtype} {tuple(out.shape)}, the header says {dtype} {tuple(shape)}")
        written = 0
        for t in ([out] if isinstance(out, torch.Tensor) else out):
            data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))
            written += data.nbytes
            del t, data  # before the next one is made: one tensor (or chunk) in memory at a time
        if written != _nbytes(dtype, shape):
            raise ValueError(f"{name}: produced {written} bytes, the header says {_nbytes(dtype, shape)}")
        total += written
        del out
    return total


class Reader:
    """One safetensors file at `rel` in `storage`, read by range."""

    def __init__(self, storage, rel: str, size: int | None = None):
        self.storage, self.rel = storage, rel
        head = storage.read_range(rel, 0, 8)
        if len(head) < 8:
            raise FormatError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if size is not None and 8 + n > size or n > 100_000_000 or n < 2:
            raise FormatError(f"header length {n} does not fit the file")
        try:
            meta = json.loads(storage.read_range(rel, 8, n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FormatError(f"header is not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise FormatError("header is not a JSON object")
        self.metadata = meta.pop("__metadata__", {})
        if not isinstance(self.metadata, dict) or not all(isinstance(v, str) for v in self.metadata.values()):
            raise FormatError("__metadata__ is not a mapping of strings")
        self.data_start = 8 + n
        try:  # every tensor's bytes inside the data section, dtype x shape long, no gap, no overlap
            self.tensors = trust.check_header(meta, size - self.data_start if size is not None else None,
                                              in_order=self.metadata.get("format", "").startswith("raytp-"))
        except trust.Untrusted as e:
            raise FormatError(str(e)) from None

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        """(dtype, shape, absolute offset of its data)."""
        try:
            v = self.tensors[name]
        except KeyError:
            raise FormatError(f"holds no tensor {name!r}") from None
        return TORCH[v["dtype"]], tuple(v["shape"]), self.data_start + v["data_offsets"][0]

    def rows(self, name: str, start: int = 0, count: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, start + count) along dim 0 (all of a 0-d tensor), in one read: into `out` (a
        contiguous tensor of that shape and dtype) if given, with no copy on a filesystem."""
        dtype, shape, at = self.info(name)
        count = (shape[0] - start if count is None else count) if shape else None
        if shape and not (0 <= start and 0 <= count and start + count <= shape[0]):
            raise FormatError(f"{name}: rows {start}..{start + count} asked of a tensor of {shape[0]}")
        want = (count, *shape[1:]) if shape else ()
        if out is None:
            out = torch.empty(want, dtype=dtype)
        elif out.dtype != dtype or tuple(out.shape) != want or not out.is_contiguous():
            raise FormatError(f"{name}: cannot read {dtype} {want} into {out.dtype} {tuple(out.shape)}")
        row = _nbytes(dtype, shape[1:]) if shape else _nbytes(dtype, ())
        if count == 0:
            return out
        try:
            self.storage.read_into(self.rel, at + (start * row if shape else 0),
                                   memoryview(out.view(-1).view(torch.uint8).numpy()))
        except EOFError as e:
            raise FormatError(str(e)) from None
        return out

    def block(self, name: str, rows: range, cols: range) -> torch.Tensor:
        """A block of a matrix: whole rows in one read, a block of columns one read per row."""
        dtype, shape, at = self.info(name)
        if len(shape) != 2 or not (0 <= rows.start <= rows.stop <= shape[0]
                                   and 0 <= cols.start <= cols.stop <= shape[1]):
            raise FormatError(f"{name}: block {rows} x {cols} asked of a tensor of shape {shape}")
        if cols.start == 0 and cols.stop == shape[1]:
            return self.rows(name, rows.start, len(rows))
        item = _nbytes(dtype, ())
        out = torch.empty((len(rows), len(cols)), dtype=dtype)
        for i, r in enumerate(rows):
            try:
                self.storage.read_into(self.rel, at + (r * shape[1] + cols.start) * item,
                                       memoryview(out[i].view(torch.uint8).numpy()))
            except EOFError as e:
                raise FormatError(str(e)) from None
        return out


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
