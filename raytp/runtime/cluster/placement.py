"""Placement groups: one per DP replica (per stage of it at pp > 1), one bundle per rank, packed on one node.

Each replica (one TP group, with its CP ranks: ``Layout.stage_ranks``) gets its own placement group of ``tp``
bundles of
``{GPU: 1, CPU: n}`` (``{CPU: n}`` on cpu) with strategy STRICT_PACK, so a TP
group's frequent all-reduces stay on one node's links. Replicas are asked for
on different nodes (a soft target: Ray falls back to any node that fits), so
a node loss takes at most one replica where the cluster allows. One group per
replica is what lets a job grow or shrink its DP degree while running: a
replica's group is added or removed whole, and the other replicas' workers
keep their processes. Worker (dp_rank, tp_rank) sits in bundle tp_rank of
replica dp_rank's group. With pipeline stages a replica is a ``Slots`` of one
such group per stage (each stage's TP group inside one node, the stages aimed
at nodes of their own, softly: a small cluster still fits), in stage order.

Ray cannot grow a placement group, so a TP grow that keeps a replica's
processes adds an *extension* group for the new ranks, aimed at the replica's
node and checked to have landed there (``reserve_tp``); the replica's
bundles are then a ``Slots``: its groups in rank order. Everything here takes
a replica's placement as either a plain group or a ``Slots`` (``bundle_of``,
``groups_of``, ``release``, ``nodes_of``, ``worker_options``).
"""
from __future__ import annotations

import itertools
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytp import names
from raytp.config import JobConfig
from raytp.runtime.errors import PlacementError
from raytp.runtime.spread import copy_key, off_their_twins, spread_targets
from raytp.runtime.cluster.autoscaler import ask as ask_capacity, withdraw as withdraw_capacity  # noqa: F401
from raytp.runtime.cluster.drains import draining  # noqa: F401
from raytp.runtime.cluster.resources import (candidate_nodes, check_room, explain_shortfall, free_by_node,  # noqa: F401
                                            replica_need, worker_resources)
from raytp.runtime.cluster.slots import (Slots, bundle_of, carve, extended, groups_of, replaced, size_of,  # noqa: F401
                                 trimmed, unused_groups)

__all__ = ["PlacementError", "Slots"]  # and the functions below

_GENERATION = itertools.count()  # group names must be unique while the old ones of a resize live


def request_replicas(cfg: JobConfig, run: str, tp: int, dp_ranks: list[int],
                     avoid_nodes: set[str] = frozenset()) -> dict[int, PlacementGroup]:
    """Ask for one STRICT_PACK group of `tp` bundles for each DP rank in `dp_ranks`, each aimed at a node
    of its own; {dp_rank: group}, not waited for (a pending group is also a demand the autoscaler sees)."""
    return _request(cfg, run, tp, dp_ranks, avoid_nodes)[0]


def _request(cfg: JobConfig, run: str, tp: int, dp_ranks: list[int], avoid_nodes) -> tuple[dict, dict]:
    """request_replicas, and the node each group was aimed at ({group id: node id or None})."""
    need = replica_need(cfg, tp)
    targets = candidate_nodes(need, set(avoid_nodes))
    pp = cfg.parallel.pp
    aims = spread_targets(len(targets), [copy_key(cfg.layout, d, s) for d in dp_ranks for s in range(pp)])
    pgs, aimed = {}, {}
    for i, d in enumerate(dp_ranks):
        stages = []
        for s in range(pp):  # one group per stage, the stages (and replicas) aimed at nodes of their own
            target = targets[aims[i * pp + s]] if aims[i * pp + s] is not None else None
            stages.append(_group(cfg, run, tp, d, s, target))
            aimed[stages[-1].id.hex()] = target
        pgs[d] = stages[0] if pp == 1 else Slots(tuple((g, 0, tp) for g in stages))
    return pgs, aimed


def request_stage(cfg: JobConfig, run: str, dp_rank: int, stage: int, target: str) -> PlacementGroup:
    """A group for one stage of replica `dp_rank` (its `tp` bundles), aimed at node `target`; not waited for
    (check it with extension_placed: Ray's target is soft)."""
    return _group(cfg, run, cfg.layout.stage_ranks, dp_rank, stage, target)


def _group(cfg: JobConfig, run: str, tp: int, dp_rank: int, stage: int, target: str | None) -> PlacementGroup:
    name = names.replica_group(run, dp_rank, next(_GENERATION)) + (f"-pp{stage}" if cfg.parallel.pp > 1 else "")
    return placement_group([worker_resources(cfg)] * tp, strategy="STRICT_PACK", name=name,
                           _soft_target_node_id=target)


def reserve_replicas(cfg: JobConfig, run: str, tp: int, dp_ranks: list[int], timeout_s: float,
                     avoid_nodes: set[str] = frozenset()) -> dict[int, PlacementGroup]:
    """request_replicas, waited for; raises PlacementError (leaving nothing behind) if not all are
    ready within `timeout_s`. A group that landed next to another copy of its stage, off the node it was
    aimed at, is asked for again there (``respread``)."""
    pgs, aimed = _request(cfg, run, tp, dp_ranks, avoid_nodes)
    groups = [g for replica in pgs.values() for g in groups_of(replica)]
    ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        release(pgs.values())
        raise PlacementError(f"could not place the workers within {timeout_s:g}s: "
                             + explain_shortfall(cfg, tp, len(dp_ranks)))
    return respread(cfg, run, tp, pgs, aimed)


RESPREAD_TRIES, RESPREAD_WAIT_S = 4, 1.0  # a target with room takes a group in ~0.1 s


def respread(cfg: JobConfig, run: str, tp: int, pgs: dict, aimed: dict) -> dict:
    """`pgs` (placed) with each group that sits off its target beside a copy of its own stage
    (raytp.runtime.spread.off_their_twins) placed again at its target where that node has room now: a new group is asked
    for there, kept if it lands there (the old one goes), dropped otherwise. A few tries, a moment apart; from the
    second on, the misplaced groups are let go first and asked for again together: two full nodes each holding both
    copies of one stage (seen: an EP=2 job's twins 1 and 3 on one node, 0 and 2 on the other) have no room for a
    group until another leaves (placed before anything runs in them; one not placed again within
    runtime.placement_timeout_s fails the placement as a shortfall does)."""
    pgs = dict(pgs)
    for attempt in range(RESPREAD_TRIES):
        table = ray.util.placement_group_table()
        where = [(d, s, g) for d in sorted(pgs) for s, g in enumerate(groups_of(pgs[d]))]
        landed = [(copy_key(cfg.layout, d, s),
                   next(iter(table.get(g.id.hex(), {}).get("bundles_to_node_id", {}).values()), None),
                   aimed.get(g.id.hex())) for d, s, g in where]
        off = off_their_twins(landed)
        if not off:
            break
        if attempt:
            time.sleep(1.0)  # a node releasing another run's groups frees them in a moment
            release([where[i][2] for i in off])
        news = {i: _group(cfg, run, tp, where[i][0], where[i][1], landed[i][2]) for i in off}
        refs = {i: g.ready() for i, g in news.items()}
        wait_s = cfg.runtime.placement_timeout_s if attempt else RESPREAD_WAIT_S
        ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)[0])
        if attempt and len(ready) < len(refs):
            release([*pgs.values(), *news.values()])  # the old ones of `off` are gone already: skipped
            raise PlacementError(f"could not place the workers again within {wait_s:g}s, spreading copies over nodes")
        table = ray.util.placement_group_table()
        for i, new in news.items():
            d, s, old = where[i]
            node = table.get(new.id.hex(), {}).get("bundles_to_node_id", {})
            if refs[i] in ready and (attempt or landed[i][2] in node.values()):
                aimed[new.id.hex()] = landed[i][2]
                pgs[d] = new if not isinstance(pgs[d], Slots) else Slots(tuple(
                    (new if g is old else g, start, n) for g, start, n in pgs[d].parts))
                if not attempt:
                    release([old])
            else:
                release([new])
    return pgs


def kill(actors) -> None:
    """Kill actors for good; those already gone are skipped."""
    for actor in list(actors):
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def release(pgs) -> None:
    """Remove placement groups (plain groups or replicas' Slots); already removed ones are skipped."""
    for pg in [g for replica in list(pgs) for g in groups_of(replica)]:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already removed
            pass


def alive_nodes() -> list[str]:
    """Node ids of the cluster's alive nodes."""
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def placed(replicas) -> bool:
    """Whether every placement group of `replicas` is placed now, as Ray's placement-group table says (never
    waits: ``pg.ready()`` would first have to run a task in the new bundles, seconds on a node just joined)."""
    table = ray.util.placement_group_table()
    return all(table.get(pg.id.hex(), {}).get("state") == "CREATED" for r in replicas for pg in groups_of(r))


def nodes_of(pgs: dict) -> set[str]:
    """Nodes that host the given replicas' bundles, as Ray's placement-group table says."""
    table = ray.util.placement_group_table()
    out = set()
    for replica in pgs.values():
        for pg in groups_of(replica):
            out |= set(table.get(pg.id.hex(), {}).get("bundles_to_node_id", {}).values())
    return out


def request_extension(cfg: JobConfig, run: str, dp_rank: int, replica, n: int) -> tuple[PlacementGroup, str | None]:
    """Ask for `n` more bundles for replica `dp_rank` on the node of its placement `replica` (a soft
    target: Ray may put them elsewhere, see extension_placed); (group, that node), not waited for."""
    node = next(iter(nodes_of({dp_rank: replica})), None)
    pg = placement_group([worker_resources(cfg)] * n, strategy="STRICT_PACK",
                         name=names.extension_group(run, dp_rank, next(_GENERATION)), _soft_target_node_id=node)
    return pg, node


def extension_placed(pg: PlacementGroup, node: str | None) -> bool:
    """Whether a ready extension (or moved stage's) group's bundles all sit on `node` (a TP group must stay
    on one node)."""
    bundles = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
    return node is not None and bool(bundles) and set(bundles.values()) == {node}


def worker_options(cfg: JobConfig, pg, run: str, rank: int, tp_rank: int) -> dict:
    """Ray actor options for rank `rank`: its name, resources and bundle (`pg`: its replica's placement,
    a plain group or a Slots)."""
    return bundle_options(cfg, *bundle_of(pg, tp_rank), names.worker(run, rank))


def bundle_options(cfg: JobConfig, pg: PlacementGroup, index: int, name: str) -> dict:
    """Ray actor options for a worker (or a warm spare) named `name` in bundle `index` of `pg`."""
    res = worker_resources(cfg)
    return {
        "name": name,
        "namespace": names.NAMESPACE,
        "num_cpus": res["CPU"],
        "num_gpus": res.get("GPU", 0),
        "max_restarts": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index),
    }


def reserve_tp(cfg: JobConfig, run: str, pgs: dict, old_dp: int):
    """The placement of layout `cfg` for a TP change that keeps replica 0's processes, from the
    replicas' placement `pgs` at the old layout: (dp_rank -> placement, groups requested, groups no
    longer used once it is done), or None if an extension group could not be had on its replica's
    node (nothing is left reserved then). A replica that has the bundles already is trimmed; one
    that lacks some gets an extension group aimed at its node; added replicas get groups of their
    own. Raises PlacementError (leaving nothing behind) if the capacity is not there in time."""
    tp, dp = cfg.layout.stage_ranks, cfg.parallel.dp
    out, unused, ext = {}, [], {}
    for q in range(min(dp, old_dp)):
        have = size_of(pgs[q])
        if have >= tp:
            out[q], spare = trimmed(pgs[q], tp)
            unused += spare
        else:
            ext[q] = request_extension(cfg, run, q, pgs[q], tp - have)
    added = request_replicas(cfg, run, tp, list(range(old_dp, dp)), avoid_nodes=nodes_of(pgs)) if dp > old_dp else {}
    requested = [pg for pg, _ in ext.values()] + list(added.values())
    wait_placed(cfg, requested)
    if not all(extension_placed(pg, node) for pg, node in ext.values()):
        release(requested)
        return None
    for q, (pg, _) in ext.items():
        out[q] = extended(pgs[q], pg, tp - size_of(pgs[q]))
    return {**out, **added}, requested, unused


def wait_placed(cfg: JobConfig, requested: list) -> None:
    """Wait for the placement groups `requested` for layout `cfg`; raises PlacementError (releasing them)
    if they are not all placed within runtime.placement_timeout_s."""
    timeout = cfg.runtime.placement_timeout_s
    if requested:
        ready, _ = ray.wait([g.ready() for g in requested], num_returns=len(requested), timeout=timeout)
        if len(ready) < len(requested):
            release(requested)
            raise PlacementError(f"could not place the workers within {timeout:g}s: "
                                 + explain_shortfall(cfg, cfg.layout.stage_ranks, cfg.parallel.dp))


def reserve_stages(cfg: JobConfig, run: str, pgs: dict, old_dp: int, old_pp: int):
    """The placement of layout `cfg` for a change of the stages at the same TP degree that keeps the
    processes of replica 0's stages present at both layouts: each replica's stage s < old_pp keeps its
    old group; other stages get groups of their own. (dp_rank -> placement, groups requested, groups no
    longer used once it is done). Raises PlacementError (leaving nothing behind) if the capacity is not
    there in time."""
    tp, pp, dp = cfg.layout.stage_ranks, cfg.parallel.pp, cfg.parallel.dp

    def old_stages(q: int) -> list:  # replica q's placement, stage by stage (runs of tp bundles)
        replica = pgs[q]
        if old_pp == 1:
            return [replica]
        out, run_, n = [], [], 0
        for part in replica.parts:
            run_.append(part)
            n += part[2]
            if n >= tp:
                out.append(Slots(tuple(run_)))
                run_, n = [], 0
        return out

    out, requested, unused = {}, [], []
    for q in range(max(dp, old_dp)):
        have = old_stages(q) if q < old_dp else []
        if q >= dp:
            unused += [g for st in have for g in groups_of(st)]
            continue
        unused += [g for st in have[pp:] for g in groups_of(st)]
        stages = []
        for s in range(pp):
            if s < len(have):
                stages.append(have[s])
                continue
            g = placement_group([worker_resources(cfg)] * tp, strategy="STRICT_PACK",
                                name=f"{names.replica_group(run, q, next(_GENERATION))}-pp{s}")
            requested.append(g)
            stages.append(g)
        out[q] = stages[0] if pp == 1 else Slots(tuple(
            part for st in stages for part in (st.parts if isinstance(st, Slots) else ((st, 0, tp),))))
    wait_placed(cfg, requested)
    return out, requested, unused
