"""A change of an MoE job's expert-parallel degree alone, carried out (``switch_ep``): every worker keeps its
process, placement, dense slices and their AdamW state (TP, PP and DP stay, so under zero 1 its rows too);
the state mover's plan (raytp.moves) says which blocks move: each expert a rank gains, from a holder on its
node where there is one, and under zero 1 the experts' AdamW rows, cut again over the new expert-DP. Each
source exports its blocks once, through the object store; each rank fills its new shard from its old one and
the bundles sent to it (raytp.runtime.worker.planned_source). Returns the group at the new layout and the
bytes moved, or raises reshard.SwitchFailed carrying the old layout to go on with.
"""
from __future__ import annotations

from raytp.config.adapters import model_args
from raytp.moves.planner import World, plan_moves
from raytp.moves.table import model_table
from raytp.runtime.elastic.reshard import SwitchFailed, rejoined
from raytp.runtime.errors import FAILURES
from raytp.runtime.worker.planned_source import PlannedSource


def switch_ep(group, new_cfg, step: int):
    """`group` at another expert-parallel degree (the same TP, PP and DP) after `step` steps: every worker
    keeps its process and placement, leaves its groups, joins the new layout's and rebuilds its shard from
    its old one and the blocks the plan sends it: (new group, bytes moved). A failure after the export rolls
    back: the workers take back their old shards and rejoin."""
    old, new = group.layout, new_cfg.layout
    p = new_cfg.parallel
    table = model_table(model_args(new_cfg), p.pp_virtual, p.pp_layers)
    nodes = dict(enumerate(group.nodes()))
    everyone = range(new.world_size)
    world = World(frozenset(range(old.world_size)), {r: r for r in everyone}, nodes, nodes)
    moves = plan_moves(table, old, new, world, state=step > 0)  # before the first update AdamW has no state
    try:
        sent, moved = group.state_calls().export_moves(moves)
    except FAILURES as e:
        raise SwitchFailed(group, e) from e
    try:
        nxt = group.successor(new_cfg, group.pgs, list(group.workers))
        mine: dict[int, list] = {r: [] for r in everyone}
        for m in moves:
            mine[m.dst].append(m)
        states = {r: PlannedSource(tuple(sent.get(r, ())), tuple(mine[r])) for r in everyone}
        nxt = nxt.join(reshape=everyone, states=states)
        nxt.commit_reshape(everyone)
    except FAILURES as e:
        raise SwitchFailed(_reverted(group), e) from e
    return nxt, moved


def _reverted(group):
    """The old layout again after a failed EP switch: every worker takes back its old shard and rejoins."""
    try:
        group.revert(range(group.layout.world_size))
    except FAILURES:
        return group  # the next step fails and recovers
    return rejoined(group)
