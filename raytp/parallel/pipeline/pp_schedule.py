"""Pipeline schedules as pure tables: which forward and backward each stage runs, in which order. No processes.

A table has one list of ``Action``s per stage; stage s runs its list in order. The model is cut into
``p * v`` consecutive chunks (v = virtual stages per stage); chunk c lives on stage ``c % p``, so with v > 1
each stage holds v chunks spread along the model (Megatron's interleaving). An action is the forward
("F") or the backward ("B") of one chunk on one micro-batch.

- ``one_f_one_b``: Megatron's non-interleaved 1F1B (PipeDream-Flush; Narayanan et al. 2021, section 2.2.1,
  ``forward_backward_pipelining_without_interleaving``): stage s runs min(p-s-1, m) warm-up forwards,
  then one forward one backward, then the cool-down backwards. It holds at most p - s micro-batches of
  activations and idles (p-1)/(m+p-1) of the step.
- ``interleaved_1f1b``: Megatron's interleaved 1F1B (section 2.2.2,
  ``forward_backward_pipelining_with_interleaving``): forwards go through the stage's chunks in groups of
  p micro-batches; min(2(p-s-1) + (v-1)p, m*v) warm-up forwards. Requires m % p == 0. It idles
  (p-1)/(v*m+p-1) of the step (``simulate`` finds exactly that) and holds 2(p-s-1) + (v-1)p + 1 chunk
  activations (capped at m*v) on stage s.

Micro-batches enter every chunk in increasing order, forwards and backwards alike, so gradients
accumulate in the same order on every run. ``check`` proves a table right: every action once, on its
chunk's stage, F before B, increasing order per chunk, and no deadlock under ``simulate``'s model
(sends never block; an action waits for its input).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

SCHEDULES = ("1f1b", "interleaved")


class ScheduleError(ValueError):
    """A schedule that cannot run as asked, or a table that is wrong; the message says what and where."""


@dataclass(frozen=True)
class Action:
    kind: str   # "F" (forward) or "B" (backward)
    mb: int     # micro-batch index, 0..m-1
    chunk: int  # model chunk, 0..p*v-1; chunk c lives on stage c % p

    def __post_init__(self):
        if self.kind not in ("F", "B"):
            raise ScheduleError(f"an action's kind is 'F' or 'B', not {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.mb}, chunk={self.chunk})"


Table = list[list[Action]]


def _check_degrees(p: int, m: int, v: int) -> None:
    for name, value in (("p (pipeline stages)", p), ("m (micro-batches)", m), ("v (virtual stages)", v)):
        if value < 1:
            raise ScheduleError(f"{name} must be >= 1, got {value}")


def one_f_one_b(p: int, m: int) -> Table:
    """Megatron's non-interleaved 1F1B for p stages and m micro-batches (chunk == stage)."""
    _check_degrees(p, m, 1)
    table = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [Action("F", i, s) for i in range(warm)]
        for i in range(m - warm):  # steady state: the next forward, then the oldest backward
            acts += [Action("F", warm + i, s), Action("B", i, s)]
        acts += [Action("B", i, s) for i in range(m - warm, m)]  # cool-down
        table.append(acts)
    return table


def _virtual(kind: str, k: int, stage: int, p: int, v: int) -> Action:
    """The k-th forward (or backward) of `stage` in Megatron's interleaved order: groups of p micro-batches
    go through the stage's chunks in turn, first to last for forwards and last to first for backwards."""
    group, at = divmod(k, p * v)
    local = at // p
    if kind == "B":
        local = v - 1 - local
    return Action(kind, group * p + at % p, local * p + stage)


def interleaved_1f1b(p: int, m: int, v: int) -> Table:
    """Megatron's interleaved 1F1B with v chunks per stage (chunk c on stage c % p); needs m % p == 0.
    With v == 1 it is ``one_f_one_b(p, m)``."""
    _check_degrees(p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        lo, hi = m - m % p, m - m % p + p
        near = f"{lo} or {hi}" if lo else f"{hi}"
        raise ScheduleError(
            f"the interleaved schedule needs the number of micro-batches to be a multiple of the pipeline "
            f"degree, as Megatron's does: m={m}, p={p} (use m = {near}, or the '1f1b' schedule)")
    total = m * v
    table = []
    for s in range(p):
        # Megatron-Core's count (older Megatron ran all forwards first when m == p: same step time, more
        # activations held on the later stages).
        warm = min(2 * (p - s - 1) + (v - 1) * p, total)
        fwd = [_virtual("F", k, s, p, v) for k in range(total)]
        bwd = [_virtual("B", k, s, p, v) for k in range(total)]
        acts = fwd[:warm]
        for i in range(total - warm):
            acts += [fwd[warm + i], bwd[i]]
        acts += bwd[total - warm:]
        table.append(acts)
    return table


def schedule(name: str, p: int, m: int, v: int = 1) -> Table:
    """The table of schedule `name` (one of SCHEDULES). '1f1b' takes no virtual stages (v must be 1)."""
    if name == "1f1b":
        if v != 1:
            raise ScheduleError(f"the '1f1b' schedule has one chunk per stage (v=1), got v={v}; "
                                f"use 'interleaved' for virtual stages")
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    raise ScheduleError(f"unknown pipeline schedule {name!r}; choices: {', '.join(SCHEDULES)}")


def peers(action: Action, p: int, v: int) -> tuple[int | None, int | None]:
    """(stage the action receives its input from, stage it sends its output to); None at the model's ends.
    A forward flows chunk c-1 -> c -> c+1, a backward the other way; the last chunk's backward starts from
    its own forward's loss. With p == 1 a peer is the stage itself (a hand-off, no message)."""
    last = p * v - 1
    before = None if action.chunk == 0 else (action.chunk - 1) % p
    after = None if action.chunk == last else (action.chunk + 1) % p
    return (before, after) if action.kind == "F" else (after, before)


def _input(a: Action, last: int) -> Action | None:
    """The action whose output `a` needs before it can start (None: the first chunk's forward)."""
    if a.kind == "F":
        return Action("F", a.mb, a.chunk - 1) if a.chunk > 0 else None
    return Action("B", a.mb, a.chunk + 1) if a.chunk < last else Action("F", a.mb, a.chunk)


@dataclass(frozen=True)
class Timeline:
    makespan: float                 # when the last action ends (the step starts at 0)
    busy: tuple[float, ...]         # per stage: time spent running actions
    held: tuple[int, ...]           # per stage: most (micro-batch, chunk) activations held at once
    start: dict                     # Action -> start time

    def idle(self, stage: int) -> float:
        """The share of the step `stage` is not running an action."""
        return 1 - self.busy[stage] / self.makespan


def simulate(table: Table, p: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0) -> Timeline:
    """Run `table` on a model of the pipeline: each stage runs its actions in order, one at a time; an
    action starts when its stage is free and its input is there (F(mb, c) after F(mb, c-1); B(mb, c) after
    B(mb, c+1), or after F(mb, c) for the last chunk); sends never block and take no time. t_f and t_b are
    one action's times (one chunk, one micro-batch). Raises ScheduleError naming the stuck actions when no
    stage can go on while actions remain (a deadlock)."""
    if len(table) != p:
        raise ScheduleError(f"the table has {len(table)} stages, but p={p}")
    last = p * v - 1
    finish: dict[Action, float] = {}
    start: dict[Action, float] = {}
    pos, free = [0] * p, [0.0] * p
    held, most = [0] * p, [0] * p
    left = sum(len(acts) for acts in table)
    while left:
        moved = False
        for s, acts in enumerate(table):
            while pos[s] < len(acts):
                a = acts[pos[s]]
                need = _input(a, last)
                if need is not None and need not in finish:
                    break
                start[a] = max(free[s], finish[need] if need is not None else 0.0)
                free[s] = finish[a] = start[a] + (t_f if a.kind == "F" else t_b)
                held[s] += 1 if a.kind == "F" else -1
                most[s] = max(most[s], held[s])
                pos[s] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [f"stage {s} waits at {acts[pos[s]]} for {_input(acts[pos[s]], last)}"
                     for s, acts in enumerate(table) if pos[s] < len(acts)]
            raise ScheduleError("the schedule deadlocks: " + "; ".join(stuck))
    busy = tuple(sum(t_f if a.kind == "F" else t_b for a in acts) for acts in table)
    return Timeline(max(finish.values(), default=0.0), busy, tuple(most), start)


def check(table: Table, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleError unless `table` is a correct schedule of p stages, m micro-batches and v virtual
    stages: every (mb, chunk) has one F and one B, on stage chunk % p; F before B on each stage; forwards
    and backwards of each chunk in increasing micro-batch order; no deadlock (see ``simulate``)."""
    _check_degrees(p, m, v)
    if len(table) != p:
        raise ScheduleError(f"the table has {len(table)} stages, but p={p}")
    n = p * v
    count = Counter()
    for s, acts in enumerate(table):
        for a in acts:
            if not (0 <= a.mb < m and 0 <= a.chunk < n):
                raise ScheduleError(f"stage {s} runs {a}, but m={m} and p*v={n} (mb in 0..{m - 1}, "
                                    f"chunk in 0..{n - 1})")
            if a.chunk % p != s:
                raise ScheduleError(f"stage {s} runs {a}, but chunk {a.chunk} lives on stage {a.chunk % p}")
            count[a] += 1
    for c in range(n):
        for mb in range(m):
            for kind in ("F", "B"):
                a = Action(kind, mb, c)
                if count[a] != 1:
                    what = "is missing" if count[a] == 0 else f"appears {count[a]} times"
                    raise ScheduleError(f"{a} {what} (stage {c % p})")
    for s, acts in enumerate(table):
        done: set[tuple[int, int]] = set()
        order: dict[tuple[str, int], list[int]] = {}
        for a in acts:
            if a.kind == "F":
                done.add((a.mb, a.chunk))
            elif (a.mb, a.chunk) not in done:
                raise ScheduleError(f"stage {s} runs {a} before its forward")
            order.setdefault((a.kind, a.chunk), []).append(a.mb)
        for (kind, c), mbs in order.items():
            if mbs != sorted(mbs):
                name = "forwards" if kind == "F" else "backwards"
                raise ScheduleError(f"stage {s} runs the {name} of chunk {c} in micro-batch order {mbs}, "
                                    f"not increasing")
    simulate(table, p, v)


def bubble(p: int, m: int, v: int = 1) -> float:
    """The analytic idle share of a step (Narayanan et al. 2021): (p-1)/(v*m + p-1); v = 1 is 1F1B's."""
    _check_degrees(p, m, v)
    return (p - 1) / (v * m + p - 1)
