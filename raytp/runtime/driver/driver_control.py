"""The Driver's side of the control actor: what `raytp status` shows, and the stop and scale requests
it files, served at step boundaries (a part of raytp.runtime.driver.driver.Driver, kept apart: the Driver
class mixes it in and owns every attribute it reads)."""
from __future__ import annotations

import time

from raytp.runtime.records import Outcome, State, StopRequest


class DriverControl:
    _published: tuple = (None, None)  # (the status last published, less elapsed_s; the placement of its ranks)
    _waiting: tuple = ()              # requests taken from the control actor, not served yet

    def status(self) -> dict:
        """What `raytp status` shows."""
        return {**self._summary(), "elapsed_s": time.perf_counter() - self.t_start, "ranks": self._ranks()}

    def _summary(self) -> dict:
        lay = self.layout
        return {"state": self.state.value, "step": self.step, "steps": self.cfg.train.steps,
                "tp": lay.tp, "dp": lay.dp, "world_size": lay.world_size,
                "loss": self.last.get("loss"), "val_loss": self.last.get("val_loss"),
                "tokens_per_s": self.last.get("tokens_per_s"), "step_time_s": self.last.get("step_time_s"),
                "failures": self.failures, "spares": len(self.spares.pool),
                "run_dir": str(self.run_dir.resolve())}

    def _ranks(self) -> list[dict]:
        return [{k: p.get(k) for k in ("rank", "actor", "node_id", "pid", "gpu_ids")}
                for p in (self.group.placement if self.group is not None else ())]

    def publish(self) -> None:
        """Hand the control actor the status if it changed; the rank list (a line per rank) only when the
        placement did."""
        if self.control is None:
            return
        summary, placement = self._summary(), self.group.placement if self.group is not None else ()
        last, last_placement = self._published
        if summary == last and placement is last_placement:
            return
        ranks = None if placement is last_placement else self._ranks()
        self.control.publish({**summary, "elapsed_s": time.perf_counter() - self.t_start}, ranks)
        self._published = (summary, placement)

    def requests_waiting(self) -> bool:
        """Whether requests were filed (taken now, served by the next ``handle_requests``)."""
        if self.control is not None:
            self._waiting = (*self._waiting, *self.control.take_requests())
        return bool(self._waiting)

    def handle_requests(self) -> None:
        """Requests filed through the control actor, served at this step boundary."""
        if self.control is None:
            return
        self.requests_waiting()
        waiting, self._waiting = self._waiting, ()
        for req in waiting:
            if req["kind"] == "stop":
                self.request_stop(req["id"])
            elif req["kind"] == "scale":
                # answered now, or when the new layout takes over (advance_resize)
                self._answer(req["id"], self.request_resize(req["tp"], req["dp"], req["id"]))
                self.publish()
            else:
                self._answer(req["id"], Outcome.refused(f"unknown request {req['kind']!r}"))

    def request_stop(self, request_id: int | None = None, via: str = "control") -> None:
        """Stop at the next step boundary (`raytp stop`, or SIGTERM); answer `request_id` then."""
        stop = self.stop_request or StopRequest(via=via)
        self.stop_request = stop.also(request_id) if request_id is not None else stop

    def stop(self) -> None:
        """Stop at this step boundary on request: a checkpoint of the step reached, then release."""
        self.handle_requests()  # a stop filed meanwhile (`raytp stop` sends SIGTERM too) is answered as well
        path = self.save_checkpoint() if self.step > 0 else None
        self.state = State.STOPPED
        self.log.event("stopped", step=self.step, reason="requested", checkpoint=str(path) if path else None)
        for rid in self.stop_request.ids:
            self._answer(rid, Outcome(ok=True, step=self.step, checkpoint=str(path) if path else None))
        self._say(f"stopped at step {self.step} on request" + (f"; checkpoint {path}" if path else ""))

    def _answer(self, request_id: int | None, outcome: Outcome | None) -> None:
        if self.control is not None and request_id is not None and outcome is not None:
            self.control.answer(request_id, outcome)
