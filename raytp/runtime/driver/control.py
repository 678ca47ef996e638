"""The run's control actor: how `raytp status/stop/scale` reach a running job.

One small actor per run, named ``raytp.<run>.control`` in the namespace
``raytp``, created by the driver on its own node. The driver publishes its
status to it when it changes (the rank list when the placement does) and collects requests from it at step
boundaries (``ControlChannel`` is the driver's side); the CLI, from any
machine that reaches the cluster, reads the status and files requests, then
polls for their outcome. The actor holds no training state, so it costs
nothing on the hot path.
"""
from __future__ import annotations

import itertools
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytp import names

LINGER_S = 5.0  # how long a run that ends waits for the CLI to collect its last answers


class Control:
    def __init__(self, run: str):
        self.run = run
        self.status: dict = {"run": run, "state": "scheduling", "time": time.time()}
        self.requests: list[dict] = []
        self.outcomes: dict[int, dict] = {}
        self.collected: set[int] = set()
        self.ids = itertools.count(1)

    # -- driver side -----------------------------------------------------------
    def publish(self, status: dict, ranks: list[dict] | None = None) -> None:
        """The driver's status; `ranks` (where each rank runs) when it changed, else the last one stays."""
        ranks = self.status.get("ranks", []) if ranks is None else ranks
        self.status = {**status, "ranks": ranks, "run": self.run, "time": time.time()}

    def take_requests(self) -> list[dict]:
        out, self.requests = self.requests, []
        return out

    def answer(self, request_id: int, outcome: dict) -> None:
        self.outcomes[request_id] = outcome

    def uncollected(self) -> int:
        """Answers the CLI has not read yet."""
        return len(set(self.outcomes) - self.collected)

    # -- CLI side ----------------------------------------------------------------
    def get_status(self) -> dict:
        return self.status

    def request(self, kind: str, **args) -> int:
        rid = next(self.ids)
        self.requests.append({"id": rid, "kind": kind, **args})
        return rid

    def outcome(self, request_id: int) -> dict | None:
        out = self.outcomes.get(request_id)
        if out is not None:
            self.collected.add(request_id)
        return out


class ControlChannel:
    """The driver's side of the control actor: publish, take requests, answer; restarted if lost."""

    def __init__(self, run: str, say=lambda msg: None):
        self.run, self.say = run, say
        self.actor = start_control(run)
        self.ranks: list[dict] = []  # the rank list last published
        self.fresh = True            # an actor that has not been given the rank list

    def publish(self, status: dict, ranks: list[dict] | None = None) -> None:
        """`ranks` when they changed (a new actor is handed the last ones once)."""
        if ranks is not None:
            self.ranks = ranks
        elif self.fresh:
            ranks = self.ranks
        self.fresh = False
        self.actor.publish.remote(status, ranks)

    def take_requests(self) -> list[dict]:
        try:
            return ray.get(self.actor.take_requests.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            self.say("the control actor was lost; starting a new one (pending requests are dropped)")
            self.actor = start_control(self.run)
            self.fresh = True
            return []

    def answer(self, request_id: int | None, outcome) -> None:
        if request_id is not None:
            self.actor.answer.remote(request_id, outcome.to_dict())

    def close(self) -> None:
        """Wait (briefly) until the CLI has read every answer, then end the actor."""
        deadline = time.monotonic() + LINGER_S
        try:
            while ray.get(self.actor.uncollected.remote(), timeout=5) and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - it is ending anyway
            pass
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass


def start_control(run: str):
    """The control actor of `run` (a fresh one; a stale one of a dead driver is replaced)."""
    name = names.control(run)
    try:
        ray.kill(ray.get_actor(name, namespace=names.NAMESPACE))
    except ValueError:
        pass
    # On the driver's node: it must not share the fate of a worker node.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(Control).options(name=name, namespace=names.NAMESPACE, num_cpus=0, max_restarts=0,
                                       scheduling_strategy=here).remote(run)


def find_control(run: str):
    """The control actor of a running `run`, or None."""
    try:
        return ray.get_actor(names.control(run), namespace=names.NAMESPACE)
    except ValueError:
        return None


def list_runs() -> list[str]:
    """Runs with a live control actor in the connected cluster (asks the GCS; no dashboard needed)."""
    found = (names.run_of_control(a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == names.NAMESPACE)
    return sorted(r for r in found if r is not None)
