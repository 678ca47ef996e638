"""Placement groups for a Layout: each TP group inside one node, DP replicas spread.

One bundle per *TP group* (tp workers' worth of CPUs and GPUs), strategy
SPREAD: a bundle never spans nodes, so a TP group's frequent all-reduces stay
on one node's links by construction, and SPREAD puts the DP replicas on
different nodes where it can (they sync once per step). Ray's strategies
apply to a whole group, so per-rank bundles could not say "these together,
those apart"; per-group bundles can. Worker r sits in bundle r // tp.
"""
from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytp.config import JobConfig


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


def group_bundle(cfg: JobConfig, tp: int) -> dict[str, float]:
    return {k: v * tp for k, v in worker_resources(cfg).items()}


def _fmt(res: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}"


def explain_shortfall(cfg: JobConfig, tp: int, dp: int) -> str:
    """Why a layout does not fit: what each TP group needs against what each node has."""
    need = group_bundle(cfg, tp)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = sum(int(min(n["Resources"].get(k, 0.0) // v for k, v in need.items())) for n in nodes)
    have = "; ".join(f"{n['NodeManagerAddress']}: {_fmt({k: n['Resources'].get(k, 0.0) for k in need})}"
                     for n in nodes) or "no alive nodes"
    return (f"TP={tp} x DP={dp} needs {dp} node slot(s) of {_fmt(need)} (each TP group inside one node), "
            f"the cluster's nodes can hold {fits} (nodes, total resources: {have})")


def reserve(cfg: JobConfig, run: str, tp: int, dp: int, timeout_s: float) -> PlacementGroup:
    """Reserve one bundle per TP group; raises PlacementError (leaving nothing behind) on timeout."""
    pg = placement_group([group_bundle(cfg, tp)] * dp, strategy="SPREAD", name=f"raytp.{run}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(f"could not place the workers within runtime.placement_timeout_s={timeout_s:g}s: "
                             + explain_shortfall(cfg, tp, dp))
    return pg


def worker_options(cfg: JobConfig, pg: PlacementGroup, run: str, rank: int, tp: int) -> dict:
    """Ray actor options for rank `rank`: its name, resources and bundle."""
    res = worker_resources(cfg)
    return {
        "name": f"raytp.{run}.rank{rank}",
        "namespace": "raytp",
        "num_cpus": res["CPU"],
        "num_gpus": res.get("GPU", 0),
        "max_restarts": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank // tp),
    }
