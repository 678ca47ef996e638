"""The driver's states and the records of work in progress, as small typed values.

A recovery or a resize that has switched the job to its new group leaves a
record (``Healing``, ``Resizing``) until the next completed step, which logs
how long it took; a resize whose new ranks are still starting is a
``PendingResize``; an elastic job that lost capacity asks for it back with a
``GrowBack``; ``raytp stop`` and SIGTERM file a ``StopRequest``. Every answer
the control actor hands back to the CLI is an ``Outcome``.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from raytp.parallel.layout import Layout


class State(enum.Enum):
    SCHEDULING = "scheduling"  # reserving the placement, starting the actors, meeting in torch.distributed
    RUNNING = "running"
    RECOVERING = "recovering"  # workers were lost: detecting, replacing, restoring
    RESIZING = "resizing"      # switching to another layout
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Healing:
    """A recovery carried out, until the first completed step after it."""
    t0: float                      # when the failure was seen (perf_counter)
    lost_steps: int
    source: str                    # "replica", "snapshot", "snapshot copy", "checkpoint <path>", "shrink to DP=n"
    ranks: tuple[int, ...]
    spares: tuple[str, ...] = ()   # names of the warm spares that took lost ranks
    seen: float | None = None      # t0 as wall time (time.time)
    before: float | None = None    # the wall time of the last step's record before the failure


@dataclass(frozen=True)
class Resizing:
    """A resize switched to its new layout, until the first completed step at it."""
    t0: float                      # the request, or the failure that made a shrink (perf_counter)
    switch_t0: float               # when training paused for the switch
    old: Layout
    new: Layout
    bytes: int                     # state moved between workers
    reason: str                    # "requested", "capacity returned", "lost capacity; ..."
    before: float | None = None    # wall time of the last step's record before it (metrics.jsonl's "time")


@dataclass(frozen=True)
class Moving:
    """A DP replica's stage moved off the node of its twin, or off a node Ray is draining
    (raytp.runtime.recovery.respread), until the first completed step after it."""
    t0: float                      # when training paused for it (perf_counter)
    ranks: tuple[int, ...]
    from_node: str | None
    to_node: str
    before: float | None = None    # wall time of the last step's record before it (metrics.jsonl's "time")
    reason: str = "twin"           # "twin": off its DP twin's node; "drain": off a node Ray is draining


@dataclass
class PendingResize:
    """A requested resize whose new ranks are starting while the old layout trains on."""
    t0: float                      # the request (perf_counter)
    new_cfg: Any                   # the job at the new layout (JobConfig)
    change: Any                    # its plan (raytp.runtime.elastic.changes): which ranks stay, start, go
    base: tuple                    # the layout and placement groups it was planned against
    reserved: Any                  # the placement it reserved, for the switch
    requested: list                # placement groups asked for (released if it is cancelled)
    early: dict                    # rank -> (actor, bundle) started ahead
    ready: list                    # their readiness refs
    request_id: int | None = None  # the control request to answer, if any


@dataclass(frozen=True)
class AwaitingRoom:
    """A requested resize with no room beside the job and none inside its bundles: the job trains on, and
    the room is looked for again at each step boundary until runtime.placement_timeout_s is over."""
    t0: float                      # the request (perf_counter)
    target: Any                    # the layout asked for (Layout)
    base: tuple                    # the layout and placement it was asked against (resize.base)
    request_id: int | None
    why: str                       # the last shortfall, for the answer if it never comes


@dataclass(frozen=True)
class GrowBack:
    """Placement groups asked for to grow an elastic job back to its DP degree."""
    pgs: dict                      # dp_rank -> placement group (pending until placed)


@dataclass(frozen=True)
class StopRequest:
    ids: tuple[int, ...] = ()      # the control requests to answer (none for SIGTERM)
    via: str = "control"           # "control" (raytp stop) or "SIGTERM" (ray job stop, raytp stop of a job)

    def also(self, request_id: int) -> "StopRequest":
        return dataclasses.replace(self, ids=self.ids + (request_id,))


@dataclass(frozen=True)
class Outcome:
    """The answer to a control request (scale, stop), as the CLI receives it (``to_dict``)."""
    ok: bool
    error: str | None = None
    layout: str | None = None
    step: int | None = None
    bytes: int | None = None
    checkpoint: str | None = None
    note: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "extra"}
        return {**d, **self.extra}

    @classmethod
    def refused(cls, error: str) -> "Outcome":
        return cls(ok=False, error=error)


def layout_dict(lay: Layout) -> dict:
    """A layout in events: its degrees (tp, pp and dp always; any other only where it is above 1)."""
    return {a: d for a, d in lay.degrees().items() if a in ("tp", "pp", "dp") or d > 1}
