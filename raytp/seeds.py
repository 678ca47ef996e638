"""Seeds derived from integers: how raytp makes randomness a pure function of where it is used.

Data order is a function of (seed, split, step), dropout masks of (seed, step,
micro-batch, site, head): the same numbers on every layout and on every replay.
"""
from __future__ import annotations

_MASK = 0xFFFFFFFFFFFFFFFF


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix-style mixing), the same in every process."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h ^= (p + 0x9E3779B97F4A7C15 + ((h << 6) & _MASK) + (h >> 2)) & _MASK
        h = (h * 0xBF58476D1CE4E5B9) & _MASK
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF
