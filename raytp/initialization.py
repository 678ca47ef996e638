"""Initial weights as a pure function of (seed, parameter, position): any slice computed on its own.

A parameter's random values are laid out in fixed blocks (``BLOCK`` x ``BLOCK``
for a matrix, ``BLOCK**2`` elements for a vector), each drawn from a generator
seeded by (seed, parameter name, block position) alone. So the values at a
position never depend on what else is computed: the one-device model, built
whole, and a tensor-parallel shard, which computes only the blocks its slice
touches (rows of a column-parallel weight, columns of a row-parallel one, q/k/v
blocks, a vocabulary shard with its padding), hold exactly the same numbers at
every TP degree. No process ever materialises a parameter it does not own.
"""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from raytp.seeds import derive_seed

BLOCK = 128


@dataclass(frozen=True)
class InitRule:
    kind: str          # "normal", "zeros" or "ones"
    std: float = 0.0   # for "normal": N(0, std^2)


def _param_id(name: str) -> int:
    return zlib.crc32(name.encode())


def values(name: str, rule: InitRule, seed: int, full_shape: tuple[int, ...], region: tuple[slice, ...] | None = None,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The initial values of parameter `name` (of shape `full_shape`) inside `region` (one slice per dim,
    steps of 1; default: all of it). Positions past the end of a dim (vocabulary padding) are zeros."""
    region = tuple(slice(0, n) for n in full_shape) if region is None else tuple(region)
    shape = tuple(s.stop - s.start for s in region)
    if rule.kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if rule.kind == "ones":
        out = torch.ones(shape, dtype=dtype)
        _zero_padding(out, region, full_shape)
        return out
    if rule.kind != "normal":
        raise ValueError(f"{name}: unknown init kind {rule.kind!r}")
    if len(full_shape) > 2:
        raise ValueError(f"{name}: blocked init covers vectors and matrices, not shape {full_shape}")
    out = torch.zeros(shape, dtype=dtype)
    pid, g = _param_id(name), torch.Generator()
    # Vectors: blocks of BLOCK**2 elements; matrices: BLOCK x BLOCK tiles. Clipped at the tensor's edge only.
    sizes = (BLOCK * BLOCK,) if len(full_shape) == 1 else (BLOCK, BLOCK)
    spans = []
    for s, n, b in zip(region, full_shape, sizes):
        stop = min(s.stop, n)  # past n: padding, left at zero
        spans.append(range(s.start // b, (stop - 1) // b + 1) if stop > s.start else range(0))
    for pos in _product(spans):
        lo = [p * b for p, b in zip(pos, sizes)]
        hi = [min(x + b, n) for x, b, n in zip(lo, sizes, full_shape)]
        g.manual_seed(derive_seed(seed, pid, *pos))
        block = torch.randn([h - low for low, h in zip(lo, hi)], generator=g) * rule.std
        src, dst = [], []
        for s, low, h in zip(region, lo, hi):
            a, b_ = max(s.start, low), min(s.stop, h)
            src.append(slice(a - low, b_ - low))
            dst.append(slice(a - s.start, b_ - s.start))
        out[tuple(dst)] = block[tuple(src)].to(dtype)
    return out


def _product(spans):
    if len(spans) == 1:
        return [(i,) for i in spans[0]]
    return [(i, j) for i in spans[0] for j in spans[1]]


def _zero_padding(out: torch.Tensor, region, full_shape) -> None:
    for d, (s, n) in enumerate(zip(region, full_shape)):
        if s.stop > n:
            out.narrow(d, max(n - s.start, 0), s.stop - max(n, s.start)).zero_()


@contextlib.contextmanager
def no_init():
    """torch.nn.init's in-place initialisers as no-ops: modules built inside keep the storage they were
    given (empty, or meta) and never run an op on it (a first meta op loads seconds of meta kernels)."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)
