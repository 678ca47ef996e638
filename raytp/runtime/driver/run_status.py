"""What the driver publishes of a run to its control actor, and the requests filed there, as values.

``summary`` is the status `raytp status` shows, from the values the Driver hands over (``Driver.view``);
the channel (raytp.runtime.driver.control_actor.ControlChannel) keeps what it last published and the
requests waiting. ``parse`` turns a request as the control actor holds it into a typed one, which the
Driver serves at a step boundary (``Driver.handle_requests``).
"""
from __future__ import annotations

from dataclasses import dataclass

from raytp.parallel.layout import SCALED, Layout
from raytp.runtime.records import Outcome, StopRequest, layout_dict


def summary(view: dict) -> dict:
    """The status of a run from what the driver hands over (Driver.view)."""
    lay, last = view["layout"], view["last"]
    return {"state": view["state"].value, "step": view["step"], "steps": view["steps"],
            **layout_dict(lay), "world_size": lay.world_size,
            "loss": last.get("loss"), "val_loss": last.get("val_loss"),
            "tokens_per_s": last.get("tokens_per_s"), "step_time_s": last.get("step_time_s"),
            "failures": view["failures"], "spares": view["spares"], "run_dir": view["run_dir"],
            **({"client": view["client"]} if "client" in view else {})}


@dataclass(frozen=True)
class StopAsked:
    """`raytp stop`: stop at the next step boundary with a checkpoint."""
    id: int


@dataclass(frozen=True)
class ScaleAsked:
    """`raytp scale`: the degrees to change, by name (raytp.parallel.layout.SCALED; those not named are kept)."""
    id: int
    degrees: tuple[tuple[str, int], ...] = ()

    def target(self, layout: Layout) -> Layout:
        """The layout asked for, from `layout` (ValueError for degrees no layout has)."""
        return layout.changed(**dict(self.degrees))


@dataclass(frozen=True)
class ProfileAsked:
    """`raytp profile`: traces of the next `steps` steps of `ranks`."""
    id: int
    steps: int
    ranks: tuple[int, ...] | None
    memory: bool = False


@dataclass(frozen=True)
class UnknownAsked:
    id: int
    kind: str


Request = StopAsked | ScaleAsked | ProfileAsked | UnknownAsked


def parse(req: dict) -> Request:
    """A request as the control actor holds it ({"kind", "id", ...}), typed."""
    kind, rid = req["kind"], req["id"]
    if kind == "stop":
        return StopAsked(rid)
    if kind == "scale":
        return ScaleAsked(rid, tuple((a, req[a]) for a in SCALED if req.get(a) is not None))
    if kind == "profile":
        ranks = req.get("ranks")
        return ProfileAsked(rid, req["steps"], None if ranks is None else tuple(ranks), req.get("memory", False))
    return UnknownAsked(rid, kind)


class RunControl:
    """The driver's side of `raytp status/stop/scale/profile`: the channel to the run's control actor (None
    without one), the stop asked for, and the answers. It serves what needs nothing of the driver's world
    (profiles, unknown kinds) and hands back the rest, typed."""

    def __init__(self, channel):
        self.channel = channel
        self.stop: StopRequest | None = None  # a stop asked for, served at the next step boundary

    def publish(self, view: dict, elapsed_s: float) -> None:
        if self.channel is not None:
            self.channel.publish(summary(view), view["placement"], elapsed_s)

    def waiting(self) -> bool:
        """Whether requests were filed (taken now, handed out by the next ``take``)."""
        return self.channel is not None and self.channel.requests_waiting()

    def take(self) -> list[Request]:
        """The requests filed, oldest first, typed; a stop is recorded here as well."""
        out = [parse(r) for r in (self.channel.take() if self.channel is not None else ())]
        for req in out:
            if isinstance(req, StopAsked):
                self.ask_stop(req.id)
            elif isinstance(req, UnknownAsked):
                self.answer(req.id, Outcome.refused(f"unknown request {req.kind!r}"))
        return out

    def serve(self, layout, scale, profile) -> bool:
        """Serve the requests filed: a scale by `scale(target layout, request id)`, a profile by
        `profile(request)`, each answered with what it returns (a scale's None: answered when its new
        layout takes over); a target that `layout` cannot change to is refused. Whether a scale was
        served (the run's view changed)."""
        scaled = False
        for req in self.take():
            if isinstance(req, ScaleAsked):
                try:
                    target = req.target(layout)
                except ValueError as e:
                    self.answer(req.id, Outcome.refused(str(e)))
                    continue
                self.answer(req.id, scale(target, req.id))
                scaled = True
            elif isinstance(req, ProfileAsked):
                self.answer(req.id, profile(req))
        return scaled

    def ask_stop(self, request_id: int | None = None, via: str = "control") -> None:
        """Stop at the next step boundary (`raytp stop`, or SIGTERM); answer `request_id` then."""
        stop = self.stop or StopRequest(via=via)
        self.stop = stop.also(request_id) if request_id is not None else stop

    def answer(self, request_id: int | None, outcome: Outcome | None) -> None:
        if self.channel is not None and request_id is not None and outcome is not None:
            self.channel.answer(request_id, outcome)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
