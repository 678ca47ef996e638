"""Placement groups: one per DP replica, one bundle per rank, packed on one node.

Each replica (one TP group) gets its own placement group of ``tp`` bundles of
``{GPU: 1, CPU: n}`` (``{CPU: n}`` on cpu) with strategy STRICT_PACK, so a TP
group's frequent all-reduces stay on one node's links. Replicas are asked for
on different nodes (a soft target: Ray falls back to any node that fits), so
a node loss takes at most one replica where the cluster allows. One group per
replica is what lets a job grow or shrink its DP degree while running: a
replica's group is added or removed whole, and the other replicas' workers
keep their processes. Worker (dp_rank, tp_rank) sits in bundle tp_rank of
replica dp_rank's group.
"""
from __future__ import annotations

import itertools

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytp.config import JobConfig


_GENERATION = itertools.count()  # group names must be unique while the old ones of a resize live


class PlacementError(RuntimeError):
    """The cluster cannot host the layout within the timeout."""


def worker_resources(cfg: JobConfig) -> dict[str, float]:
    """What one rank reserves: {"CPU": n} on cpu, {"CPU": n, "GPU": 1} on cuda."""
    gpus = cfg.runtime.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if cfg.runtime.device == "cuda" else 0.0
    res = {"CPU": float(cfg.runtime.cpus_per_worker)}
    if gpus:
        res["GPU"] = float(gpus)
    return res


def _fmt(res: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}"


def _replica_need(cfg: JobConfig, tp: int) -> dict[str, float]:
    return {k: v * tp for k, v in worker_resources(cfg).items()}


def explain_shortfall(cfg: JobConfig, tp: int, dp: int) -> str:
    """Why a layout does not fit: what each TP group needs against what each node has."""
    need = _replica_need(cfg, tp)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = sum(int(min(n["Resources"].get(k, 0.0) // v for k, v in need.items())) for n in nodes)
    have = "; ".join(f"{n['NodeManagerAddress']}: {_fmt({k: n['Resources'].get(k, 0.0) for k in need})}"
                     for n in nodes) or "no alive nodes"
    return (f"TP={tp} x DP={dp} needs {dp} node slot(s) of {_fmt(need)} (each TP group inside one node), "
            f"the cluster's nodes can hold {fits} (nodes, total resources: {have})")


def _candidate_nodes(need: dict[str, float], avoid: set[str]) -> list[str]:
    """Alive nodes big enough for one replica, those not in `avoid` first."""
    nodes = [n for n in ray.nodes() if n.get("Alive")
             and all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())]
    ids = [n["NodeID"] for n in nodes]
    return [i for i in ids if i not in avoid] + [i for i in ids if i in avoid]


def request_replicas(cfg: JobConfig, run: str, tp: int, dp_ranks: list[int],
                     avoid_nodes: set[str] = frozenset()) -> dict[int, PlacementGroup]:
    """Ask for one STRICT_PACK group of `tp` bundles for each DP rank in `dp_ranks`, each aimed at a node
    of its own; {dp_rank: group}, not waited for (a pending group is also a demand the autoscaler sees)."""
    need = _replica_need(cfg, tp)
    targets = _candidate_nodes(need, set(avoid_nodes))
    pgs = {}
    for i, d in enumerate(dp_ranks):
        target = targets[i] if i < len(targets) else None
        pgs[d] = placement_group([worker_resources(cfg)] * tp, strategy="STRICT_PACK",
                                 name=f"raytp.{run}.replica{d}.{next(_GENERATION)}", _soft_target_node_id=target)
    return pgs


def reserve_replicas(cfg: JobConfig, run: str, tp: int, dp_ranks: list[int], timeout_s: float,
                     avoid_nodes: set[str] = frozenset()) -> dict[int, PlacementGroup]:
    """request_replicas, waited for; raises PlacementError (leaving nothing behind) if not all are
    ready within `timeout_s`."""
    pgs = request_replicas(cfg, run, tp, dp_ranks, avoid_nodes)
    ready, _ = ray.wait([pg.ready() for pg in pgs.values()], num_returns=len(pgs), timeout=timeout_s)
    if len(ready) < len(pgs):
        release(pgs.values())
        raise PlacementError(f"could not place the workers within {timeout_s:g}s: "
                             + explain_shortfall(cfg, tp, len(dp_ranks)))
    return pgs


def release(pgs) -> None:
    for pg in list(pgs):
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already removed
            pass


def nodes_of(pgs: dict[int, PlacementGroup]) -> set[str]:
    """Nodes that host the given groups' bundles, as Ray's placement-group table says."""
    table = ray.util.placement_group_table()
    out = set()
    for pg in pgs.values():
        out |= set(table.get(pg.id.hex(), {}).get("bundles_to_node_id", {}).values())
    return out


def worker_options(cfg: JobConfig, pg: PlacementGroup, run: str, rank: int, tp_rank: int) -> dict:
    """Ray actor options for rank `rank`: its name, resources and bundle."""
    res = worker_resources(cfg)
    return {
        "name": f"raytp.{run}.rank{rank}",
        "namespace": "raytp",
        "num_cpus": res["CPU"],
        "num_gpus": res.get("GPU", 0),
        "max_restarts": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=tp_rank),
    }
