"""ArchFacts: what a job needs to know of an architecture, without torch: its name, what it is, and the job
checks only it needs. raytp.config reads these through raytp.models.arch (a command line that only reads a job,
or asks a running job its status, starts in a fraction of a second); the model itself is its ModelSpec
(raytp.models.spec), which holds these facts too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# A job check: (the dotted keys it reads, the first one named in the message; ok(v); message(v)),
# v mapping dotted job keys to values (raytp.config.rules runs them, only on jobs of this architecture).
JobRule = tuple[tuple[str, ...], Callable[[dict], Any], Callable[[dict], str]]


@dataclass(frozen=True)
class ArchFacts:
    name: str                                # model.arch; also the folder of raytp.models that holds it
    title: str                               # for messages ("GPT-2")
    summary: str                             # the job key's help text
    width_key: str                           # the job key that sets the MLP width, for job messages
    width_name: str                          # the MLP width's name in the model's terms, for check_tp
    job_rules: tuple[JobRule, ...] = field(default=())


def divisors(n: int) -> str:
    """'1, 2, 4' for 4: the valid choices a job check names."""
    return ", ".join(str(i) for i in range(1, n + 1) if n % i == 0)
