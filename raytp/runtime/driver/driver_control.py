"""The Driver's side of the control actor: what `raytp status` shows, and the stop, scale and profile
requests it files, served at step boundaries (a part of raytp.runtime.driver.driver.Driver, kept apart: the
Driver mixes it in). What it publishes is ``summary`` of the values the Driver hands it (``Driver.view``); the
channel (raytp.runtime.driver.control_actor.ControlChannel) keeps what it last published and the requests
waiting; serving a request calls the Driver's own ``request_stop`` / ``request_resize``, or its profiles'
``request`` (raytp.runtime.driver.profiles)."""
from __future__ import annotations

import time

from raytp.runtime.driver.control_actor import rank_rows
from raytp.runtime.records import Outcome, State, StopRequest


def summary(view: dict) -> dict:
    """The status of a run from what the driver hands over (Driver.view)."""
    lay, last = view["layout"], view["last"]
    return {"state": view["state"].value, "step": view["step"], "steps": view["steps"],
            "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "world_size": lay.world_size,
            "loss": last.get("loss"), "val_loss": last.get("val_loss"),
            "tokens_per_s": last.get("tokens_per_s"), "step_time_s": last.get("step_time_s"),
            "failures": view["failures"], "spares": view["spares"], "run_dir": view["run_dir"]}


class DriverControl:
    def status(self) -> dict:
        """What `raytp status` shows."""
        view = self.view()
        return {**summary(view), "elapsed_s": time.perf_counter() - self.t_start,
                "ranks": rank_rows(view["placement"])}

    def publish(self) -> None:
        if self.control is not None:
            view = self.view()
            self.control.publish(summary(view), view["placement"], time.perf_counter() - self.t_start)

    def requests_waiting(self) -> bool:
        """Whether requests were filed (taken now, served by the next ``handle_requests``)."""
        return self.control is not None and self.control.requests_waiting()

    def handle_requests(self) -> None:
        """Requests filed through the control actor, served at this step boundary."""
        if self.control is None:
            return
        for req in self.control.take():
            if req["kind"] == "stop":
                self.request_stop(req["id"])
            elif req["kind"] == "scale":
                # answered now, or when the new layout takes over (advance_resize)
                self._answer(req["id"], self.request_resize(req["tp"], req["dp"], req["id"], req.get("pp")))
                self.publish()
            elif req["kind"] == "profile":  # answered now (where), and when the traces are written
                self._answer(req["id"], self.profiles.request(self.group, self.step, self.cfg.train.steps,
                                                              req["steps"], req.get("ranks"), req.get("memory", False),
                                                              req["id"]))
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
