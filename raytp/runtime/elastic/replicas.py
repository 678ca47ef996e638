"""A change of the DP degree, live (``change_dp``): a requested resize or a grow-back (the first replicas kept),
and a shrink off nodes Ray is draining (the replicas clear of them kept, any of them, renumbered 0.. in the
order given; the decision is policy.drain_keep).

The kept replicas' workers keep their processes, shards and placement; dropped replicas stop and their
placement is released; added replicas start (ahead, or now). What moves is the state mover's plan
(raytp.runtime.state.moving): an added rank takes its whole state from a live holder (on its node first, the
least loaded), and under zero 1 the AdamW rows are cut again over the new DP degree, each kept rank keeping
what it has of its new rows and taking the rest from the ranks that held them (the dropped ones too: every
rank is alive, so nothing comes from a snapshot). Weights of kept ranks never move.
"""
from __future__ import annotations

from raytp.runtime.cluster.launch import actor_id
from raytp.runtime.cluster.slots import unused_groups
from raytp.runtime.elastic.reshard import SwitchFailed, rejoined
from raytp.runtime.errors import FAILURES
from raytp.runtime.state import moving


def change_dp(group, new_cfg, keep: tuple[int, ...], step: int, reserved: dict | None = None,
              early: dict | None = None):
    """`group` at DP degree new_cfg.parallel.dp after `step` steps, with the replicas `keep` (old DP ranks,
    renumbered 0.. in this order) and added ones after them: (new group, bytes moved). `reserved`: {new DP rank:
    placement} of the added replicas (reserved now if None); `early`: {rank: (actor, bundle)} of added ranks
    started ahead. Raises SwitchFailed (with the old layout's workers wired again) if a worker fails midway."""
    old, new = group.layout, new_cfg.layout
    process_of = {j: o for i, q in enumerate(keep) for j, o in zip(new.replica(i), old.replica(q))}
    added = [j for j in range(new.world_size) if j not in process_of]
    if reserved is None:
        reserved = group.reserve(new_cfg, group.launcher.run, list(range(len(keep), new.dp)),
                                 avoid_nodes=group.placer.nodes_of(group.pgs)) if added else {}
    early = dict(early or {})
    pgs = {**{i: group.pgs[q] for i, q in enumerate(keep)}, **reserved}
    moves = moving.plan(group, new_cfg, range(old.world_size), process_of, step)
    try:
        planned, moved = moving.sources(group.state_calls(), moves)
        group.leave()
        for r in added:
            if r not in early:
                early[r] = group.start_worker(r, new_cfg, pgs)
        workers = [group.workers[process_of[j]] if j in process_of else early[j][0] for j in range(new.world_size)]
        nxt = group.successor(new_cfg, pgs, workers, bundles={actor_id(a): k for a, k in early.values()})
        nxt = nxt.join(setup=added)
        taken = moving.take(nxt.state_calls(), planned, step)
        nxt.commit_reshape(j for j in taken if j in process_of)
    except FAILURES as e:
        group.kill_actors(a for a, _ in early.values())
        group.placer.release(reserved.values())
        raise SwitchFailed(_reverted(group, sorted(process_of.values())), e) from e
    kept = set(process_of.values())
    group.kill(r for r in range(old.world_size) if r not in kept)
    group.placer.release(unused_groups([pg for q, pg in group.pgs.items() if q not in keep], nxt.pgs.values()))
    return nxt, moved


def kept_first(old_dp: int, new_dp: int) -> tuple[int, ...]:
    """The replicas a requested DP change keeps: the first min(old, new)."""
    return tuple(range(min(old_dp, new_dp)))


def _reverted(group, ranks: list[int]):
    """The old layout again: the kept ranks (`ranks`) take back the AdamW rows they cut anew, if they did (the
    weights never changed), and every worker rejoins."""
    try:
        group.revert(ranks)
    except FAILURES:
        return group  # the next step fails and recovers
    return rejoined(group)
