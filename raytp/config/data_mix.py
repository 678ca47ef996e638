"""``data.mix``: sources blended by weight, a mapping SOURCE -> weight in a job file. A pure value.

Held as a tuple of (source, weight) pairs so the job stays frozen and hashable; written back as a mapping.
"""
from __future__ import annotations

import math
from typing import Any


class Mix(tuple):
    """((source, weight), ...), weights positive (any scale: they are normalised when sampling)."""

    @classmethod
    def parse(cls, value: Any) -> "Mix":
        if isinstance(value, Mix):
            return value
        if not isinstance(value, dict) or not value:
            raise ValueError(f"expected a mapping of SOURCE: weight, e.g. {{/data/web: 0.7, /data/code: 0.3}}, "
                             f"got {value!r}")
        problems = [f"{k}: weight {w!r} is not a positive number" for k, w in value.items()
                    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0]
        problems += [f"{k!r} is not a source name (a string)" for k in value if not isinstance(k, str)]
        if problems:
            raise ValueError("; ".join(problems))
        return cls((k, float(w)) for k, w in value.items())

    def as_dict(self) -> dict:
        return dict(self)

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k}: {w:g}" for k, w in self) + "}"
