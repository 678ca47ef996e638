"""A live shrink that keeps chosen replicas: the ones clear of a node Ray is draining when no node has room
for the drained ranks (raytp.runtime.recovery.respread; the decision is policy.drain_keep).

Unlike a requested DP shrink (reshard.switch_dp keeps replicas 0..new_dp-1), the kept replicas are any, and
are renumbered 0.. in the order given, as an elastic shrink after a failure renumbers them. Every rank is
alive, the dropped ones too: under zero 1 each first cuts its AdamW rows for the new DP ranks, so nothing
comes from a snapshot. Nothing is started and no weight moves: each kept replica holds a whole copy.
"""
from __future__ import annotations

from raytp.runtime import policy
from raytp.runtime.cluster.slots import unused_groups
from raytp.runtime.elastic.reshard import SwitchFailed, rejoined, row_bundles
from raytp.runtime.errors import FAILURES


def drop_replicas(group, keep: tuple[int, ...]):
    """`group` with only the replicas `keep` (old DP ranks): (new group, bytes of AdamW rows moved). Raises
    SwitchFailed (with the old layout's workers wired again) if a worker fails midway."""
    lay = group.layout
    new_cfg = policy.resized_config(group.cfg, lay.changed(dp=len(keep)))
    rows = None
    try:
        if lay.zero:
            rows = group.state_calls().export_rows(len(keep))
        group.leave()
        workers = [group.workers[r] for q in keep for r in lay.replica(q)]
        nxt = group.successor(new_cfg, {i: group.pgs[q] for i, q in enumerate(keep)}, workers).join()
        moved = 0
        if rows is not None:
            nxt.state_calls().take_rows(row_bundles(lay, nxt.layout, rows[0]))
            moved = sum(map(sum, rows[1]))
    except FAILURES as e:
        raise SwitchFailed(rejoined(group, rows), e) from e
    group.kill(r for q in range(lay.dp) if q not in keep for r in lay.replica(q))
    group.placer.release(unused_groups([group.pgs[q] for q in range(lay.dp) if q not in keep], nxt.pgs.values()))
    return nxt, moved
