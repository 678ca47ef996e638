"""What a rank needs and what the cluster's nodes have: the resources a placement asks for, whether a
layout change has room beside the job now, and why a layout does not fit, in words.

Read from Ray's view of the nodes; the packing decision itself is pure (raytp.runtime.policy.fits_now).
"""
from __future__ import annotations

import ray

from raytp.config import JobConfig
from raytp.runtime.errors import PlacementError
from raytp.runtime.policy import fits_now


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


def replica_need(cfg: JobConfig, tp: int) -> dict[str, float]:
    return {k: v * tp for k, v in worker_resources(cfg).items()}


def explain_shortfall(cfg: JobConfig, tp: int, dp: int) -> str:
    """Why a layout does not fit: what each TP group needs against what each node has."""
    need = replica_need(cfg, tp)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = sum(int(min(n["Resources"].get(k, 0.0) // v for k, v in need.items())) for n in nodes)
    have = "; ".join(f"{n['NodeManagerAddress']}: {_fmt({k: n['Resources'].get(k, 0.0) for k in need})}"
                     for n in nodes) or "no alive nodes"
    return (f"TP={tp} x DP={dp} needs {dp} node slot(s) of {_fmt(need)} (each TP group inside one node), "
            f"the cluster's nodes can hold {fits} (nodes, total resources: {have})")


def free_by_node() -> dict[str, dict[str, float]] | None:
    """What each alive node has free now (not held by any placement group or task), by node id; None where
    this Ray does not say."""
    try:
        from ray._private.state import available_resources_per_node
        return dict(available_resources_per_node())
    except Exception:  # noqa: BLE001 - an internal API: without it, placement is waited for as before
        return None


def free_per_node() -> list[dict[str, float]] | None:
    free = free_by_node()
    return None if free is None else list(free.values())


def check_room(cfg: JobConfig, bundles: list[int], what: str) -> None:
    """Raise PlacementError at once if packed groups of these bundle counts (one rank's resources each)
    cannot be placed beside what the cluster holds now (raytp.runtime.policy.fits_now): a layout change
    that has no room is known from the resources, not from a placement timeout."""
    free = free_per_node()
    if not bundles or free is None:
        return
    per = worker_resources(cfg)
    if not fits_now(free, [{k: v * n for k, v in per.items()} for n in bundles]):
        have = "; ".join(_fmt({k: n.get(k, 0.0) for k in per}) for n in free) or "no alive nodes"
        raise PlacementError(f"no room for {what} beside the job: {len(bundles)} group(s) of "
                             f"{', '.join(str(n) for n in bundles)} x {_fmt(per)} on one node each; free per "
                             f"node now: {have}")


def candidate_nodes(need: dict[str, float], avoid: set[str]) -> list[str]:
    """Alive nodes big enough for one replica, those not in `avoid` first."""
    nodes = [n for n in ray.nodes() if n.get("Alive")
             and all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())]
    ids = [n["NodeID"] for n in nodes]
    return [i for i in ids if i not in avoid] + [i for i in ids if i in avoid]
