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
        """The outcome of a request; a later one replaces it (`raytp profile`: where, then written)."""
        self.outcomes[request_id] = outcome
        self.collected.discard(request_id)

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
    """The driver's side of the control actor: publish the status when it changed, take the requests filed
    (held until served), answer; restarted if lost. It keeps what it last published, nothing of the driver."""

    def __init__(self, run: str, say=lambda msg: None):
        self.run, self.say = run, say
        self.actor = self._start()
        self.ranks: list[dict] = []  # the rank list last published
        self.fresh = True            # an actor that has not been given the rank list
        self.last: tuple = (None, None)  # (the status last published, less elapsed_s; the placement of its ranks)
        self.waiting: tuple = ()     # requests taken from the actor, not served yet

    def publish(self, status: dict, placement: tuple, elapsed_s: float) -> None:
        """Hand the actor `status` (plus elapsed_s) if it changed; the rank list (a line per rank, of
        `placement`) only when the placement did (a new actor is handed the last one once)."""
        last_status, last_placement = self.last
        if status == last_status and placement is last_placement and not self.fresh:
            return
        ranks = None
        if placement is not last_placement:
            ranks = self.ranks = rank_rows(placement)
        elif self.fresh:
            ranks = self.ranks
        self.fresh = False
        self._send({**status, "elapsed_s": elapsed_s}, ranks)
        self.last = (status, placement)

    def requests_waiting(self) -> bool:
        """Whether requests were filed (taken now, held for ``take``)."""
        self.waiting = (*self.waiting, *self._take_requests())
        return bool(self.waiting)

    def take(self) -> tuple:
        """The requests filed, oldest first, to serve now."""
        self.requests_waiting()
        waiting, self.waiting = self.waiting, ()
        return waiting

    # -- the actor's side (a test's in-process stand-in overrides these) --
    def _start(self):
        return start_control(self.run)

    def _send(self, status: dict, ranks: list[dict] | None) -> None:
        self.actor.publish.remote(status, ranks)

    def _take_requests(self) -> list[dict]:
        try:
            return ray.get(self.actor.take_requests.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            self.say("the control actor was lost; starting a new one (pending requests are dropped)")
            self.actor = self._start()
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


def rank_rows(placement) -> list[dict]:
    """What `raytp status --ranks` lists of each rank: its actor, node, pid and GPUs."""
    return [{k: p.get(k) for k in ("rank", "actor", "node_id", "pid", "gpu_ids")} for p in placement]


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
