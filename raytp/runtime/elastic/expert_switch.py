"""A change of an MoE job's expert-parallel degree alone, carried out (``switch_ep``): every worker keeps its
process, placement, dense slices and their AdamW state (TP, PP and DP stay, so under zero 1 its rows too);
each expert a rank gains comes once from one old holder of the same slice
(raytp.runtime.elastic.rank_plans.expert_sources), through the object store
(raytp.runtime.worker.expert_moves). Returns the group at the new layout and the bytes moved, or raises
reshard.SwitchFailed carrying the old layout to go on with.
"""
from __future__ import annotations

from raytp.runtime.elastic import rank_plans
from raytp.runtime.elastic.reshard import SwitchFailed, rejoined
from raytp.runtime.errors import FAILURES
from raytp.runtime.worker.expert_moves import ExpertsSource


def switch_ep(group, new_cfg):
    """`group` at another expert-parallel degree (the same TP, PP and DP): every worker keeps its process and
    placement, leaves its groups, joins the new layout's and rebuilds its shard from its old one and the
    experts it gains, each from one old holder (raytp.runtime.worker.expert_moves): (new group, bytes moved).
    A failure after the export rolls back: the workers take back their old shards and rejoin."""
    old, new = group.layout, new_cfg.layout
    sources = rank_plans.expert_sources(old, new, new_cfg.model.moe.n_experts)
    try:
        refs, sizes = group.state_calls().export_experts(new_cfg.model.moe.n_experts)
    except FAILURES as e:
        raise SwitchFailed(group, e) from e
    everyone = range(new.world_size)
    try:
        nxt = group.successor(new_cfg, group.pgs, list(group.workers))
        states = {r: ExpertsSource(tuple(refs[o][j] for j, o in sorted(sources[r].items()))) for r in everyone}
        nxt = nxt.join(reshape=everyone, states=states)
        nxt.commit_reshape(everyone)
    except FAILURES as e:
        raise SwitchFailed(_reverted(group), e) from e
    return nxt, sum(sizes[o][j] for need in sources.values() for j, o in need.items())


def _reverted(group):
    """The old layout again after a failed EP switch: every worker takes back its old shard and rejoins."""
    try:
        group.revert(range(group.layout.world_size))
    except FAILURES:
        return group  # the next step fails and recovers
    return rejoined(group)
