"""A TP change (or any TP change at pp > 1) that starts the job's layout in placement of its own: the state
mover's plan (raytp.runtime.elastic.reshard.switch) with no process kept. Beside the job (``restart_tp``: new
placement groups for every replica, every worker new, started there ahead while the job trained on, named
``names.worker_ahead`` where a running worker holds the rank's name), or inside the job's own bundles
(``restart_in``: the old process in each new rank's bundle takes the new rank and reshapes; no process
starts, the pause is the export and the rebuild; where that cannot be, the new ranks start there once the
old ones stopped). The old workers not kept stop once the new layout took; a
failure rolls back to them.
"""
from __future__ import annotations

from raytp.runtime.cluster.launch import actor_id, bundle_key
from raytp.runtime.cluster.slots import bundle_of
from raytp.runtime.elastic.reshard import switch


def restart_tp(group, new_cfg, step: int, ahead: int, new_pgs: dict | None = None, early: dict | None = None):
    """`group` at another TP degree (or any TP change at pp > 1) in new placement groups for every replica,
    every worker new, the state moved worker to worker: (new group, bytes moved). `new_pgs`: the new
    layout's placement, reserved beside the job (reserved now if None); `early`: {rank: (actor, bundle)}
    of every new rank, started there ahead while the job trained on (started now, as the `ahead`-th resize
    that starts every worker ahead, if None)."""
    new = new_cfg.layout
    if new_pgs is None:
        new_pgs = group.reserve(new_cfg, group.launcher.run, list(range(new.dp)))
    early = dict(early or {})
    try:
        for r in range(new.world_size):
            if r not in early:
                early[r] = group.start_worker(r, new_cfg, new_pgs, ahead=ahead)
        nxt, moved = switch(group, new_cfg, step, new_pgs, {}, early)
    except BaseException:
        group.kill_actors(a for a, _ in early.values())
        group.placer.release(new_pgs.values())
        raise
    group.placer.release(group.pgs.values())
    return nxt, moved


def restart_in(group, new_cfg, step: int, new_pgs: dict):
    """`group` at `new_cfg`'s layout inside the job's own bundles (`new_pgs` carved from them): the old process in
    each new rank's bundle takes that rank and reshapes where every new rank's bundle holds one (one stage each
    side); else every new rank starts there once the old ones stop: (new group, bytes moved)."""
    kept = _holders(group, new_cfg.layout, new_pgs)
    late = [] if kept else range(new_cfg.layout.world_size)
    return switch(group, new_cfg, step, new_pgs, kept or {}, {}, late)


def _holders(group, new, new_pgs: dict) -> dict | None:
    """{new rank: the old rank sitting in the bundle the rank takes} where every new rank's bundle is an old
    worker's (a switch inside the job's own bundles, one stage each side), else None."""
    if new.pp > 1 or group.layout.pp > 1:
        return None
    by_bundle = {group.bundles.get(actor_id(w)): r for r, w in enumerate(group.workers)}
    out = {}
    for r in range(new.world_size):
        pg, index = bundle_of(new_pgs[new.coords(r).dp], new.bundle_index(r))
        out[r] = by_bundle.get(bundle_key(pg, index))
        if out[r] is None:
            return None
    return out
