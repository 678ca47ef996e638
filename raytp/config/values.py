"""The values a job's schema is written in and how its messages write them: ConfigError, valid ranges
(Range), lists of integers (IntList), and a key or value as the user would write it (at, show, literal,
type_name). Pure, and imported by the schema, the parser and the checks alike.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Optional


class ConfigError(Exception):
    """A job file or override is invalid; `.problems` holds one line per problem."""

    def __init__(self, problems: list[str] | str):
        if isinstance(problems, str):  # so the error survives pickling
            problems = problems.splitlines()
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Range:
    """Valid numeric interval for a field, e.g. Range(0, 1, hi_open=True) is [0, 1)."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v: float) -> bool:
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        hi_ok = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return lo_ok and hi_ok  # NaN fails both comparisons, as it should

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return (f"in {'(' if self.lo_open else '['}{self.lo:g}, "
                f"{self.hi:g}{')' if self.hi_open else ']'}")


class IntList(tuple):
    """A job value that is a list of integers (YAML ``[2, 3]``), held as a tuple so the job stays frozen."""

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self)) + "]"


POSITIVE = Range(0, lo_open=True)
NONNEG = Range(0)
UNIT = Range(0, 1, hi_open=True)  # [0, 1)


# How keys and values are written in messages.

def unwrap(tp: Any) -> tuple[type, bool]:
    """Optional[X] -> (X, True); X -> (X, False)."""
    if typing.get_origin(tp) is typing.Union:
        return [a for a in typing.get_args(tp) if a is not type(None)][0], True
    return tp, False


def type_name(tp: Any) -> str:
    base, optional = unwrap(tp)
    name = ("list of integers" if base is IntList else
            "mapping" if dataclasses.is_dataclass(base) or hasattr(base, "parse") else base.__name__)
    return name + (" or null" if optional else "")


def show(v: Any) -> str:
    """A value as the user would write it in YAML."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def literal(v: Any) -> str:
    return repr(v) if isinstance(v, str) else show(v)


def at(where: str, key: str) -> str:
    """'jobs/x.yaml: train.lr' or '--set train.lr'."""
    return f"--set {key}" if where == "--set" else f"{where}: {key}"
