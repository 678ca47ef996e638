"""A TP change (or any TP change at pp > 1) that restarts the job's layout in placement of its own: every
old owner cuts its shard into bundles for the new layout (in the object store: one per new TP rank and stage),
and the new layout's workers fill their shards from them. Beside the job (``restart_tp``: new placement groups
for every replica, every worker new, at pp > 1 started there ahead while the job trained on), or inside the
job's own bundles (``restart_in``: the old process in each new rank's bundle takes the new rank). On a failure
the old layout starts again from the same bundles (raytp.runtime.elastic.reshard.restarted_from).
"""
from __future__ import annotations

from raytp.parallel.ownership import Ownership
from raytp.runtime.cluster.launch import actor_id, bundle_key
from raytp.runtime.cluster.slots import bundle_of
from raytp.runtime.elastic.reshard import SwitchFailed, new_stages, restarted_from
from raytp.runtime.errors import FAILURES
from raytp.runtime.worker.transfer import PiecesSource


def restart_tp(group, new_cfg, new_pgs: dict | None = None, early: dict | None = None):
    """`group` at another TP degree (or any TP change at pp > 1) in new placement groups for every replica,
    every worker new, the state moved worker to worker: (new group, bytes moved). `new_pgs`: the new
    layout's placement, reserved beside the job (reserved now if None); `early`: {rank: (actor, bundle)}
    of every new rank, started there ahead while the job trained on (started now if None)."""
    new = new_cfg.layout
    if new_pgs is None:
        new_pgs = group.reserve(new_cfg, group.launcher.run, list(range(new.dp)))
    try:
        nxt, moved = restart_in(group, new_cfg, new_pgs, early)
    except SwitchFailed:
        group.kill_actors(a for a, _ in (early or {}).values())
        group.placer.release(new_pgs.values())
        raise
    group.placer.release(group.pgs.values())
    return nxt, moved


def restart_in(group, new_cfg, new_pgs: dict, early: dict | None = None):
    """Every worker of `group` cuts its shard into bundles for the new layout (in the object store: one per
    new TP rank and stage, each holding only that stage's layers), stops, and the new layout's workers
    (`early`: {rank: (actor, bundle)} started ahead in `new_pgs`, else started now) fill their shards from
    the bundles: (new group, bytes moved). Inside the job's own bundles (`new_pgs` carved from them) the
    old process in each new rank's bundle takes the new rank instead of stopping (no process start: the
    pause is the export and the rebuild). On a failure the old layout starts again, in its own placement,
    from the same bundles."""
    old, new = group.layout, new_cfg.layout
    stages = new_stages(new_cfg)
    try:
        if early:  # one lost while it started: the old layout goes on untouched
            group.check_up(a for a, _ in early.values())
        exported = group.export_pieces(new.tp, stages=stages)
    except FAILURES as e:
        raise SwitchFailed(group, e) from e
    refs, replicated, sizes = exported
    owners = Ownership(old).parts

    def slot(r: int) -> int:  # the bundle of each old owner that new rank r takes
        at = new.coords(r)
        return at.tp * len(stages) + (at.pp if new.pp > 1 else 0)

    kept = None if early else _holders(group, new, new_pgs)
    # (the new ranks started now take the old names and, in place, bundles; kept processes keep theirs)
    group.kill(r for r in range(old.world_size) if kept is None or group.workers[r] not in kept.values())
    nxt = None
    try:
        sources = {r: PiecesSource(tuple(refs[i][slot(r)] for i in range(owners)), new_cfg.model.vocab_size)
                   for r in range(new.world_size)}
        if kept:  # in place: each new rank's bundle is an old worker's, whose process takes the new rank
            nxt = group.successor(new_cfg, new_pgs, [kept[r] for r in range(new.world_size)])
            nxt = nxt.join(reshape=range(new.world_size), states=sources)
            nxt.commit_reshape(range(new.world_size))
        elif early:
            nxt = group.successor(new_cfg, new_pgs, [early[r][0] for r in range(new.world_size)],
                                  bundles={actor_id(a): k for a, k in early.values()})
            nxt = nxt.join(setup=range(new.world_size), states=sources)
        else:
            nxt = type(group).create(group.launcher, new_cfg, new_pgs).join(setup=range(new.world_size),
                                                                             states=sources)
    except FAILURES as e:
        if nxt is not None:
            nxt.kill(range(new.world_size))
        raise SwitchFailed(restarted_from(group, refs, replicated), e) from e
    return nxt, sum(sizes[i][slot(r)] for r in range(new.world_size) for i in range(owners))


def _holders(group, new, new_pgs: dict) -> dict | None:
    """{new rank: the old worker sitting in the bundle the rank takes} where every new rank's bundle is an
    old worker's (a switch inside the job's own bundles, one stage each side), else None."""
    if new.pp > 1 or group.layout.pp > 1:
        return None
    by_bundle = {group.bundles.get(actor_id(w)): w for w in group.workers}
    out = {}
    for r in range(new.world_size):
        pg, index = bundle_of(new_pgs[new.coords(r).dp], new.bundle_index(r))
        out[r] = by_bundle.get(bundle_key(pg, index))
        if out[r] is None:
            return None
    return out
