"""Where the copies of a shard sit, as pure functions: which single node losses a layout survives, where to
aim each replica's placement groups, and which copy to move once a node has room.

A shard survives its node's loss without a checkpoint when a rank on another node holds the same bytes
(raytp.moves.owners: its DP replicas) or the snapshots' off-node copy lives elsewhere. Placement aims
the copies of each stage at nodes of their own (``spread_targets``); Ray's target is soft, so a copy can
land beside its twin on a full cluster, and ``move_off_twin`` says which one to move, and where, once a
node has room. Nothing here imports Ray (tests/test_spread.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from raytp.parallel.layout import Layout
from raytp.moves.owners import Owners


def copy_key(layout: Layout, dp: int, stage: int) -> tuple:
    """What the (replica `dp`, stage `stage`) TP group holds, as far as copies go: its stage; with experts on a
    mesh of their own also the EP places of its ranks (replicas holding other experts are no copies of it:
    at DP=4 x EP=2 replicas 0 and 2 hold experts 0-1, 1 and 3 experts 2-3)."""
    if not layout.experts_split or dp >= layout.dp:  # (a replica past the layout: a grow-back's, dense only)
        return (stage,)
    return (stage, tuple(sorted({layout.coord(r, "ep") for r in layout.stage_group(dp, stage)})))


def spread_targets(nodes: int, keys: Sequence[tuple]) -> list[int | None]:
    """Which of `nodes` candidate nodes (indices) each placement group aims at (`keys`: each group's
    copy_key, replica by replica, stage by stage): the least loaded node that holds no other group of the same
    key, if any (so one node's loss leaves every stage, and every expert, a copy), else the least loaded;
    None without nodes."""
    load, held, out = [0] * nodes, [set() for _ in range(nodes)], []
    for key in keys:
        if not nodes:
            out.append(None)
            continue
        n = min(range(nodes), key=lambda i: (key in held[i], load[i], i))
        load[n] += 1
        held[n].add(key)
        out.append(n)
    return out


def off_their_twins(landed: Sequence[tuple[tuple, str | None, str | None]]) -> list[int]:
    """Which placement groups to ask for again, from (copy_key, node it landed on, node it was aimed at) of
    each group: those that landed off their target on a node that holds another copy of the same (that
    node's loss would take both; Ray's target is soft, and a node still releasing a run's groups is passed
    over). Indices into `landed`."""
    count: dict = {}
    for stage, node, _ in landed:
        count[(stage, node)] = count.get((stage, node), 0) + 1
    return [i for i, (stage, node, target) in enumerate(landed)
            if target is not None and node != target and count[(stage, node)] > 1]


def node_losses(layout: Layout, nodes: Sequence[str | None], copy_node: str | None = None) -> dict[str, bool]:
    """For each node that holds ranks (`nodes`: each rank's node): whether the job survives its loss
    without a checkpoint: every rank on it holds bytes that a rank on another node holds too
    (Owners.holders: its DP replicas), or the off-node copy of the snapshots (`copy_node`, None
    without one) lives on another node."""
    out = _losses(Owners(layout).first_holders(), nodes)
    if copy_node is not None:
        out = {node: ok or copy_node != node for node, ok in out.items()}
    return out


def _losses(first: Sequence[int], nodes: Sequence[str | None]) -> dict[str, bool]:
    """node_losses without the snapshots' copy, from each rank's first holder (`first`: ranks with the same one
    hold the same bytes)."""
    spans: dict[int, set] = {}  # each set of holders -> the nodes its ranks are on
    for r, n in enumerate(nodes):
        spans.setdefault(first[r], set()).add(n)
    out: dict[str, bool] = {}
    for r, node in enumerate(nodes):  # a rank's loss is covered where its holders span another node too
        if node is not None:
            out[node] = out.get(node, True) and len(spans[first[r]]) > 1
    return out


def survival_line(losses: Mapping[str, bool], names: Mapping[str, str],
                  by_replica: Mapping[str, bool] | None = None) -> str:
    """The start line's words for node_losses' answer (`names`: a node's name to show, its address;
    `by_replica`: node_losses without the snapshots' copy, to say which losses roll back to it)."""
    if all(losses.values()):
        copied = [names.get(n, n) for n, ok in (by_replica or {}).items() if not ok]
        if copied:
            return (f"survives the loss of any 1 node without a checkpoint (of node {', '.join(copied)} from "
                    f"the snapshots' copy on another node, once it holds one (its `snapshot_copy` event with "
                    f"`first_step`): the steps since it are run again)")
        return "survives the loss of any 1 node without a checkpoint"
    bad = [names.get(n, n) for n, ok in losses.items() if not ok]
    return f"a loss of node {', '.join(bad)} needs the checkpoint (no copy of its shards on another node)"


@dataclass(frozen=True)
class Move:
    """Move stage `stage` of replica `dp` (its TP group: one placement group) to node `node`."""
    dp: int
    stage: int
    node: str
    drain: bool = False  # off a node Ray is draining: the group's own ranks hand their state over (any layout)


def move_off_twin(layout: Layout, nodes: Sequence[str | None], free: Mapping[str, Mapping[str, float]],
                  need: Mapping[str, float]) -> Move | None:
    """The one move of a (replica, stage) TP group that most reduces the node losses needing a checkpoint
    (node_losses, without the snapshots' copy: the copies themselves should be apart), or None if no move
    reduces them. `nodes`: each rank's node; `free`: each alive node's free resources; `need`: what the
    group needs on one node. Later replicas move first (replica 0 makes the snapshots), then the least
    loaded target node."""
    if len(nodes) < layout.world_size or None in nodes:
        return None
    first = Owners(layout).first_holders()
    bad = _needing_checkpoint(first, nodes)
    if not bad:
        return None
    load = {n: sum(1 for m in nodes if m == n) for n in free}
    best: tuple[int, Move] | None = None
    # Groups holding the same bytes (the same first holders) moved from the same node to the same node leave
    # the same node losses: each such move is counted once (a replica's stage at 1024 ranks: 128 -> a few).
    counted: dict[tuple, int] = {}
    for d in reversed(range(layout.dp)):
        for s in range(layout.pp):
            ranks = layout.stage_group(d, s)
            here = {nodes[r] for r in ranks}
            if len(here) != 1:
                continue
            for node in sorted(free, key=lambda n: (load[n], n)):
                if node in here or not all(free[node].get(k, 0.0) >= v for k, v in need.items()):
                    continue
                key = (tuple(sorted(first[r] for r in ranks)), next(iter(here)), node)
                if key not in counted:
                    moving = set(ranks)
                    moved = [node if r in moving else n for r, n in enumerate(nodes)]
                    counted[key] = _needing_checkpoint(first, moved)
                after = counted[key]
                if after < bad and (best is None or after < best[0]):
                    best = (after, Move(d, s, node))
    return best[1] if best else None


def move_off_drained(layout: Layout, nodes: Sequence[str | None], draining: Collection[str],
                     free: Mapping[str, Mapping[str, float]], need: Mapping[str, float]) -> Move | None:
    """The move of the first (replica, stage) TP group with a rank on a node being drained (`draining`) to a
    node with room that is not drained: one holding no other copy of that stage if there is one (its loss
    then still needs no checkpoint), the least loaded first; None when nothing is on a drained node or no
    node has room. `nodes`, `free`, `need`: as move_off_twin's."""
    if len(nodes) < layout.world_size or None in nodes:
        return None
    load = {n: sum(1 for m in nodes if m == n) for n in free}
    fits = [n for n in free if n not in draining and all(free[n].get(k, 0.0) >= v for k, v in need.items())]
    for d in range(layout.dp):
        for s in range(layout.pp):
            if not any(nodes[r] in draining for r in layout.stage_group(d, s)):
                continue
            twins = {nodes[r] for q in range(layout.dp) if q != d for r in layout.stage_group(q, s)}
            if fits:
                return Move(d, s, min(fits, key=lambda n: (n in twins, load[n], n)), drain=True)
            return None
    return None


def could_move(layout: Layout, nodes: Sequence[str | None]) -> bool:
    """Whether a node with room would let move_off_twin reduce the losses that need a checkpoint (never
    under zero 1, where no rank's bytes are held twice): only then is the cluster's room worth reading."""
    return move_off_twin(layout, nodes, {"": {}}, {}) is not None


def _needing_checkpoint(first: Sequence[int], nodes: Sequence[str | None]) -> int:
    return sum(not ok for ok in _losses(first, nodes).values())
