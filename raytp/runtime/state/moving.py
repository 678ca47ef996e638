"""A plan of the state mover (raytp.moves) carried out on a worker group: the one way state moves between live
processes and from the in-memory snapshots.

``plan(old_group, new_cfg, alive, process_of, ...)`` asks the pure planner which blocks every rank of the new
layout takes from where, with the group's nodes (a source on the rank's own node first); ``Unplannable`` if
some block has no source. ``sources(calls, moves, parts)`` has the live sources export their blocks (one call
each, through the object store: raytp.runtime.cluster.group_state.StateCalls.export_moves) and gives every
new rank its ``PlannedSource`` (raytp.runtime.worker.planned_source): the bundles sent to it, the snapshot
parts it reads, its moves. A rank builds a new shard from one (``join(reshape=.., states=..)``: a TP, PP or
EP change) or fills the shard it holds (``take``: a recovery, a DP change, a move to another node).
"""
from __future__ import annotations

from typing import Iterable, Mapping

from raytp.config.adapters import model_args
from raytp.moves.planner import Move, SourceKind, World, plan_moves
from raytp.moves.table import StateTable, model_table
from raytp.moves.owners import Owners
from raytp.runtime.worker.planned_source import PlannedSource


def table(cfg) -> StateTable:
    """The placement table of `cfg`'s model (raytp.moves.table)."""
    p = cfg.parallel
    return model_table(model_args(cfg), p.pp_virtual, p.pp_layers)


def plan(group, new_cfg, alive: Iterable[int], process_of: Mapping[int, int], step: int,
         new_nodes: Mapping[int, str | None] | None = None, snapshot: bool = False) -> list[Move]:
    """The moves that give every rank of `new_cfg`'s layout its state from `group`'s (at its layout; `alive`:
    its ranks whose processes serve, at step `step`; `process_of`: {new rank: the old rank whose process it
    runs in}; `new_nodes`: each new rank's node where not its process's; `snapshot`: the snapshot parts,
    one per owner of `group`'s layout, hold what the live ranks lack). Raises raytp.moves.planner.Unplannable."""
    old_nodes = dict(enumerate(group.nodes()))
    nodes = {j: old_nodes.get(o) for j, o in process_of.items()}
    nodes.update({j: n for j, n in (new_nodes or {}).items() if n is not None})
    owners = frozenset(Owners(group.layout).owners()) if snapshot else frozenset()
    world = World(frozenset(alive), dict(process_of), old_nodes, nodes, owners)
    # before the first update AdamW has no state: the weights alone move
    return plan_moves(table(new_cfg), group.layout, new_cfg.layout, world, state=step > 0)


def snapshot_parts(layout, parts: Mapping[int, object]) -> dict[int, object]:
    """{old rank: ref of its packed state} of a snapshot's `parts` ({part: ref}, raytp.moves.owners)."""
    own = Owners(layout)
    return {own.owner(p): ref for p, ref in parts.items()}


def sources(calls, moves: list[Move], parts: Mapping[int, object] | None = None) -> tuple[dict, int]:
    """({new rank: its PlannedSource}, bytes moved) of `moves`: the live sources (`calls`: the old layout's
    StateCalls) export their blocks now; `parts`: {old rank: ref of its snapshot part} for the moves from
    the snapshot (snapshot_parts)."""
    sent, moved = calls.export_moves(moves)
    mine: dict[int, list] = {}
    for m in moves:
        mine.setdefault(m.dst, []).append(m)
    out = {}
    for j, ms in mine.items():
        read = sorted({m.source.rank for m in ms if m.source.kind is SourceKind.SNAPSHOT})
        out[j] = PlannedSource(tuple(sent.get(j, ())), tuple(ms), tuple((o, parts[o]) for o in read))
    moved += sum(m.nbytes for m in moves if m.source.kind is SourceKind.SNAPSHOT)
    return out, moved


def take(calls, planned: Mapping[int, PlannedSource], step: int, also: Iterable[int] = ()) -> list[int]:
    """The ranks whose state changes by their plans (and those in `also`, whose step count is set all the same)
    fill the shards they hold (`calls`: the new layout's StateCalls), as the state after `step`; returns
    them. A rank's blocks kept whole are skipped unless its AdamW rows are cut again (HeldShard.take_moves)."""
    todo = {r: src for r, src in planned.items() if not all(m.kept for m in src.moves)}
    todo.update({r: planned.get(r, PlannedSource((), ())) for r in also})
    calls.take_moves(todo, step)
    return sorted(todo)
