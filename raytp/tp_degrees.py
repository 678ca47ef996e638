"""Which TP degrees a model's shape splits over: a pure rule, shared by the job checks (raytp.config, which
import no torch) and the TP plan (raytp.parallel.sharding)."""
from __future__ import annotations

import math


def kv_fits(kv_heads: int, tp: int) -> bool:
    """Key/value heads split over tp ranks (tp divides them) or shared by them (tp a multiple of them)."""
    return kv_heads % tp == 0 or tp % kv_heads == 0


def tp_degrees(n_head: int, kv_heads: int, mlp_width: int) -> list[int]:
    """The TP degrees that divide the query heads and the MLP width and fit the KV heads."""
    g = math.gcd(n_head, mlp_width)
    return [d for d in range(1, g + 1) if g % d == 0 and kv_fits(kv_heads, d)]
