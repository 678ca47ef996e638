"""The state mover's plan: every layout change and every recovery as typed slice moves. Pure.

``plan_moves(table, old, new, world)`` reads which region of which tensor each
rank holds on the old layout and must hold on the new one (the placement table,
raytp.moves.table) and which old processes serve and where (``World``), and
says, for every new rank, where each block of its state comes from:

1. the process that becomes it, if that process held the block (nothing moves:
   a kept rank keeps what it has);
2. else a live old rank holding it on the new rank's node, then anywhere
   (the least loaded first, so that replicas share the sending); a tensor a
   live rank holds exactly as wanted, of which the rank's own process holds
   nothing, comes whole from one (a new replica, a lost rank's replacement);
3. else the in-memory snapshot of an old rank that held it;
4. else the checkpoint; if there is none, ``Unplannable`` names what is gone.

A rank of the same layout whose own live process holds all it must gets no move
at all (a survivor of a recovery). So a recovery is a plan whose lost ranks
serve nothing, a DP grow one whose new replicas' processes are fresh, a TP, PP,
EP or ZeRO re-cut one whose regions differ: one planner for all. Each ``Move`` is a box contiguous in both the
source's local tensor (the old rank's, whichever kind serves it) and the new
rank's; a new rank's moves cover every element of its state exactly once.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from raytp.moves.regions import Box, Region, cells, contains, edges, touches
from raytp.moves.table import Held, StateTable
from raytp.parallel.layout import Layout


class SourceKind(enum.Enum):
    LIVE = "live"                # an old rank's process, serving
    SNAPSHOT = "snapshot"        # an old rank's part of the in-memory snapshots
    CHECKPOINT = "checkpoint"    # the checkpoint of the same state


@dataclass(frozen=True)
class Source:
    kind: SourceKind
    rank: int  # the old rank whose local tensor the move's source box indexes


@dataclass(frozen=True)
class Move:
    key: str
    source: Source
    dst: int          # the new rank
    box: Box          # a_at: in the source's local tensor; b_at: in the new rank's
    itemsize: int
    in_place: bool    # the source is the new rank's own process: no byte leaves it
    kept: bool = False  # in place, the whole tensor as it was: a rank that keeps its shard has nothing to do

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.itemsize


@dataclass(frozen=True)
class World:
    """The processes as the plan finds them."""
    alive: frozenset[int]                    # old ranks whose processes serve
    process_of: dict[int, int] = field(default_factory=dict)  # new rank -> the old rank whose process it runs in
    old_nodes: dict[int, str] = field(default_factory=dict)   # old rank -> node (unknown: none shared)
    new_nodes: dict[int, str] = field(default_factory=dict)   # new rank -> node
    snapshot: frozenset[int] = frozenset()   # old ranks whose held state the snapshots hold
    checkpoint: bool = False                 # a checkpoint of the same state is there


WINDOW = 8  # holders weighed for each block (the least loaded of them sends it)


class Unplannable(ValueError):
    """No source holds some of the new state: no live rank, snapshot or checkpoint has it."""


def plan_moves(table: StateTable, old: Layout, new: Layout, world: World, state: bool = True) -> list[Move]:
    """Every move that makes the state of `new` from that of `old` in `world` (see the module doc); the
    weights alone without `state` (before the first update AdamW has none)."""
    before = table.held(old, state)
    after = before if new == old else table.held(new, state)
    holders = table.holders(old, state)
    sent: dict[int, int] = {}  # bytes each live old rank sends so far: the next block goes to the least loaded
    cut: dict = {}  # (key, region wanted) -> its cells and their holders: the same for every replica
    live_of: dict = {}  # id of a holders tuple -> its live ranks
    box_of: dict = {}  # a region's shape -> the box of all of it
    pools: dict = {}  # (id of a live_of list, node) -> the holders to weigh for a rank on that node
    out: list[Move] = []
    for j, held in enumerate(after):
        mine = world.process_of.get(j)
        own = before[mine] if mine in world.alive else {}
        if own is held:  # the same layout, and its process holds all it must: nothing to do
            continue
        node = world.new_nodes.get(j)
        for key, want in held.items():
            kept = own.get(key)
            shape = want.region.shape
            if kept is not None and kept.region == want.region:  # all of it in place: the common case, at once
                box = box_of.get(shape) or box_of.setdefault(shape, _whole(shape))
                out.append(Move(key, Source(SourceKind.LIVE, mine), j, box, want.itemsize, True, True))
                continue
            if kept is None:
                same = holders.get(key, {}).get(want.region, ())
                live = live_of.get(id(same))
                if live is None:
                    live = live_of[id(same)] = [i for i in same if i in world.alive]
                if live:  # its process holds none of it and a live rank holds all of it: whole, from one
                    box = box_of.get(shape) or box_of.setdefault(shape, _whole(shape))
                    pool = pools.get((id(live), node))
                    if pool is None:
                        pool = pools[id(live), node] = _pool(live, node, world)
                    i = _least_loaded(pool, j, sent, want.region.numel * want.itemsize)
                    out.append(Move(key, Source(SourceKind.LIVE, i), j, box, want.itemsize, False))
                    continue
            if (key, want.region) not in cut:
                cut[key, want.region] = _cells(want.region, holders.get(key, {}), world)
            out += _fill(key, want, j, cut[key, want.region], world, sent)
    return out


def _cells(want: Region, have: dict[Region, tuple[int, ...]], world: World) -> list[tuple[Region, dict, list, list]]:
    """`want` cut into cells no holder's edge crosses, each with {holder: its region}, its holders and its live
    holders (ascending)."""
    cuts = edges(want)
    have = {region: ranks for region, ranks in have.items() if touches(region, want)}  # the others hold none of it
    for region in have:
        for d, e in enumerate(edges(region)):
            cuts[d] |= e
    out = []
    for cell in cells(want, cuts):
        if cell.numel:
            by = {i: region for region, ranks in have.items() if contains(region, cell) for i in ranks}
            ranks = sorted(by)
            out.append((cell, by, ranks, [i for i in ranks if i in world.alive]))
    return out


def _fill(key: str, want: Held, j: int, cut: list, world: World, sent: dict) -> list[Move]:
    """The moves of one tensor of new rank `j`: each of its cells from its source."""
    chosen: dict[Source, list[Region]] = {}
    region_of: dict[int, Region] = {}
    for cell, by, ranks, live in cut:
        src = _source(key, j, ranks, live, world, sent, cell.numel * want.itemsize)
        region_of[src.rank] = by[src.rank]
        chosen.setdefault(src, []).append(cell)
    out = []
    for src, got in chosen.items():
        region = region_of[src.rank]
        own = src.kind is SourceKind.LIVE and world.process_of.get(j) == src.rank
        for box in merge([Box(_at(region, c), _at(want.region, c), c.shape) for c in got]):
            out.append(Move(key, src, j, box, want.itemsize, own))
    return out


def _source(key: str, j: int, ranks: list[int], live: list[int], world: World, sent: dict, nbytes: int) -> Source:
    """The source of one cell of new rank `j`, held by old `ranks` (`live` of them serve; ascending): the module
    doc's order. The least loaded of up to WINDOW holders, from a place that turns with `j`: balanced sending,
    without a scan of every holder of a tensor every rank holds."""
    mine = world.process_of.get(j)
    if mine is not None and mine in world.alive and mine in ranks:
        return Source(SourceKind.LIVE, mine)
    if live:
        return Source(SourceKind.LIVE, _least_loaded(_pool(live, world.new_nodes.get(j), world), j, sent, nbytes))
    snap = [i for i in ranks if i in world.snapshot]
    if snap:
        return Source(SourceKind.SNAPSHOT, snap[0])
    if world.checkpoint and ranks:
        return Source(SourceKind.CHECKPOINT, ranks[0])
    raise Unplannable(f"{key} of new rank {j}: " + (f"its old holders {ranks} are gone, with no snapshot of "
                                                    "theirs and no checkpoint" if ranks else "no old rank held it"))


def _whole(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), (0,) * len(shape), shape)


def _pool(live: list[int], node: str | None, world: World) -> list[int]:
    """The live holders on `node` if there are any, else all of them."""
    pool = [i for i in live if world.old_nodes.get(i) == node] if node is not None else []
    return pool or live


def _least_loaded(pool: list[int], j: int, sent: dict, nbytes: int) -> int:
    """The holder of `pool` that has sent the least so far (the lowest rank of equals), among up to WINDOW of them
    from a place that turns with new rank `j`; it is charged `nbytes`."""
    if len(pool) > WINDOW:
        at = j % len(pool)
        pool = (pool[at:] + pool[:at])[:WINDOW]
    best, load = pool[0], sent.get(pool[0], 0)
    for i in pool[1:]:
        n = sent.get(i, 0)
        if n < load or (n == load and i < best):
            best, load = i, n
    sent[best] = load + nbytes
    return best


def _at(region: Region, cell: Region) -> tuple[int, ...]:
    """Where cell `cell` (inside `region`) starts in `region`'s local tensor."""
    out = []
    for d, ((lo, _),) in enumerate(cell.dims):
        out.append(next(at + lo - a for a, b, at in region.local(d) if a <= lo < b))
    return tuple(out)


def merge(boxes: list[Box]) -> list[Box]:
    """Boxes joined where two are adjacent along one dim in both tensors and equal across the others."""
    boxes = sorted(boxes, key=lambda b: (b.b_at, b.a_at))
    for d in range(len(boxes[0].size) if boxes else 0):
        out: list[Box] = []
        for b in sorted(boxes, key=lambda b: (tuple(x for k, x in enumerate(b.b_at) if k != d), b.b_at[d])):
            p = out[-1] if out else None
            if p is not None and _adjacent(p, b, d):
                size = tuple(s + (b.size[d] if k == d else 0) for k, s in enumerate(p.size))
                out[-1] = Box(p.a_at, p.b_at, size)
            else:
                out.append(b)
        boxes = out
    return sorted(boxes, key=lambda b: b.b_at)


def _adjacent(p: Box, b: Box, d: int) -> bool:
    others = [k for k in range(len(p.size)) if k != d]
    return (all(p.a_at[k] == b.a_at[k] and p.b_at[k] == b.b_at[k] and p.size[k] == b.size[k] for k in others)
            and p.a_at[d] + p.size[d] == b.a_at[d] and p.b_at[d] + p.size[d] == b.b_at[d])


def moved_bytes(moves: list[Move]) -> int:
    """Bytes that leave a process (in-place moves cost none)."""
    return sum(m.nbytes for m in moves if not m.in_place)
