"""The run's control actor: how `raytp status/stop/scale` reach a running job.

One small actor per run, named ``raytp.<run>.control`` in the namespace
``raytp``, created by the driver. The driver publishes its status to it after
every call and collects requests from it at step boundaries; the CLI, from any
machine that reaches the cluster, reads the status and files requests, then
polls for their outcome. The actor holds no training state, so it costs
nothing on the hot path.
"""
from __future__ import annotations

import itertools
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "raytp"


def control_name(run: str) -> str:
    return f"raytp.{run}.control"


class Control:
    def __init__(self, run: str):
        self.run = run
        self.status: dict = {"run": run, "state": "scheduling", "time": time.time()}
        self.requests: list[dict] = []
        self.outcomes: dict[int, dict] = {}
        self.ids = itertools.count(1)

    # -- driver side -----------------------------------------------------------
    def publish(self, status: dict) -> None:
        self.status = {**status, "run": self.run, "time": time.time()}

    def take_requests(self) -> list[dict]:
        out, self.requests = self.requests, []
        return out

    def answer(self, request_id: int, outcome: dict) -> None:
        self.outcomes[request_id] = outcome

    # -- CLI side ----------------------------------------------------------------
    def get_status(self) -> dict:
        return self.status

    def request(self, kind: str, **args) -> int:
        rid = next(self.ids)
        self.requests.append({"id": rid, "kind": kind, **args})
        return rid

    def outcome(self, request_id: int) -> dict | None:
        return self.outcomes.get(request_id)


def start_control(run: str):
    """The control actor of `run` (a fresh one; a stale one of a dead driver is replaced)."""
    name = control_name(run)
    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    except ValueError:
        pass
    # On the driver's node: it must not share the fate of a worker node.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(Control).options(name=name, namespace=NAMESPACE, num_cpus=0, max_restarts=0,
                                       scheduling_strategy=here).remote(run)


def find_control(run: str):
    """The control actor of a running `run`, or None."""
    try:
        return ray.get_actor(control_name(run), namespace=NAMESPACE)
    except ValueError:
        return None


def list_runs() -> list[str]:
    """Runs with a live control actor in the connected cluster (asks the GCS; no dashboard needed)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    return sorted(n[len("raytp."):-len(".control")] for n in names
                  if n.startswith("raytp.") and n.endswith(".control"))
