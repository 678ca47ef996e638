"""Moving a running job's state to another layout: the switch a resize (or a grow-back) carries out.

Each function takes the group at the old layout and returns the group at the
new one with every rank holding its shard, and the bytes that moved; or raises
``SwitchFailed`` carrying the group to go on with (the old layout, rolled back).

- DP change (``switch_dp``): the staying replicas' workers keep their processes
  and shards; removed replicas stop and their placement is released; added
  replicas (started ahead, or now) copy their shards from replica 0, worker to
  worker through the object store.
- TP change (``switch_tp``): replica 0's shards are joined into the one-device
  state (in the object store); replica 0's first min(old, new) TP ranks keep
  their processes and reshape in place, every other rank starts anew, and
  every worker builds its shard empty (no seeded initialisation) and takes its
  slices. Nothing touches the disk. A failure after the state was gathered
  restarts the old layout from it.
- TP change where the bundles could not be had on a replica's node, and any
  TP change at pp > 1 or to or from it: raytp.runtime.elastic.restart.
- Change of the stages at the same TP degree (``switch_stages``): replica 0's
  stages present at both layouts keep their processes and placement groups
  and reshape to their new layers; the others start (ahead where they can);
  every old owner cuts one bundle per new TP rank and stage, holding only
  that stage's layers, so each byte moves once (a tied embedding's second
  copy twice).

A change of the expert-parallel degree alone is raytp.runtime.elastic.expert_switch.
"""
from __future__ import annotations

from raytp.config.adapters import model_args
from raytp.models.stage import stage_of
from raytp.parallel.ownership import Ownership
from raytp.runtime.elastic import rank_plans
from raytp.runtime.errors import FAILURES
from raytp.runtime.cluster.launch import actor_id
from raytp.runtime.cluster.slots import unused_groups
from raytp.runtime.worker.transfer import PiecesSource, RebuildSource


class SwitchFailed(Exception):
    """A switch failed midway and was rolled back: go on with `group`."""

    def __init__(self, group, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.group, self.cause = group, cause


def switch_dp(group, new_cfg, step: int, reserved: dict | None = None, early: dict | None = None, plan=None):
    """`group` at DP degree new_cfg.parallel.dp: (new group, bytes moved). `reserved`: placement of the
    added replicas (reserved now if None); `early`: {rank: (actor, bundle)} of added ranks started ahead;
    `plan`: the request's rank_plans.dp_resize_ranks (made here if None). Under zero 1 every rank first cuts
    the AdamW rows it keeps into bundles for the new DP ranks (``row_bundles``); added ranks copy only the weights."""
    old_dp, new_dp = group.layout.dp, new_cfg.parallel.dp
    plan = plan or rank_plans.dp_resize_ranks(group.layout.replica_size, old_dp, new_dp)
    added = list(range(old_dp, new_dp))
    if reserved is None:
        reserved = group.reserve(new_cfg, group.launcher.run, added,
                                 avoid_nodes=group.placer.nodes_of(group.pgs)) if added else {}
    early = dict(early or {})
    pgs = {**{q: pg for q, pg in group.pgs.items() if q < new_dp}, **reserved}
    rows = None
    try:
        if group.layout.zero:
            rows = group.state_calls().export_rows(new_dp)
        group.leave()
        for r in plan.early:
            if r not in early:
                early[r] = group.start_worker(r, new_cfg, pgs)
        workers = list(group.workers[:len(plan.kept)]) + [early[r][0] for r in plan.early]
        nxt = group.successor(new_cfg, pgs, workers, bundles={actor_id(a): k for a, k in early.values()})
        nxt = nxt.join(setup=plan.early)
        own = Ownership(nxt.layout)
        zero = rows is not None  # only the weights are copied (under zero 1 each rank owns its own rows)
        # An added rank takes the bytes it holds from the first rank holding the same.
        donors = {r: (own.weight_holders(r) if zero else own.holders(r))[0] for r in plan.early}
        moved = nxt.state_calls().copy_shards(donors, step, weights_only=zero)
        if zero:
            nxt.state_calls().take_rows(row_bundles(group.layout, nxt.layout, rows[0]))
            moved += sum(map(sum, rows[1]))
    except FAILURES as e:
        group.kill_actors(a for a, _ in early.values())
        group.placer.release(reserved.values())
        raise SwitchFailed(rejoined(group, rows), e) from e
    group.kill(plan.removed)
    group.placer.release(unused_groups([group.pgs[q] for q in range(new_dp, old_dp)], nxt.pgs.values()))
    return nxt, moved


def row_bundles(old, new, refs: list) -> dict[int, list]:
    """{rank of layout `new`: the bundles of AdamW rows it takes}: from every rank of `old` at its TP rank and
    stage, the bundle cut for its DP rank (`refs[old rank][new DP rank]`, Group.export_rows)."""
    out = {}
    for r in range(new.world_size):
        at = new.coords(r)
        out[r] = [refs[o][at.dp] for o in old.dp_group(at.tp, at.pp)]
    return out


def switch_tp(group, new_cfg, reserved: tuple, early: dict, plan):
    """`group` at TP degree new_cfg.parallel.tp, keeping replica 0's first min(old, new) ranks' processes:
    (new group, bytes moved). `reserved`: placement.reserve_tp's placement; `early`: {rank: (actor,
    bundle)} of the ranks whose names were free, started ahead. The state moves worker to worker
    (raytp.runtime.worker.transfer); the driver passes references only. `plan`: the request's
    rank_plans.tp_resize_ranks."""
    old, new = group.layout, new_cfg.layout
    new_pgs, requested, unused = reserved
    started = [a for a, _ in early.values()]
    exported = reshaped = None
    try:
        # A kept process keeps its own slices; they are exported too only for the other DP replicas.
        exported = group.export_pieces(new.tp, skip={r: {r} for r in plan.kept} if new.dp == 1 else None)
        refs, _, sizes = exported
        group.kill(plan.removed)  # their names and bundles go to the new layout; their bundles stay in the store
        late = {r: group.start_worker(r, new_cfg, new_pgs) for r in plan.late}
        started += [a for a, _ in late.values()]
        news = {**late, **early}
        workers = list(group.workers[:len(plan.kept)]) + [news[r][0] for r in sorted(news)]
        nxt = group.successor(new_cfg, new_pgs, workers, bundles={actor_id(a): k for a, k in news.values()})
        sources = {r: PiecesSource(tuple(None if (r in plan.kept and i == r) else refs[i][new.coords(r).tp]
                                         for i in range(old.tp)), new_cfg.model.vocab_size)
                   for r in range(new.world_size)}
        reshaped = plan.kept
        nxt = nxt.join(setup=range(len(plan.kept), new.world_size), reshape=plan.kept, states=sources)
        nxt.commit_reshape(plan.kept)
    except FAILURES as e:
        group.kill_actors(started)
        group.placer.release(requested)
        if exported is None:  # the old layout was not touched: it goes on as it was
            raise SwitchFailed(group, e) from e
        raise SwitchFailed(_rolled_back(group, plan, exported, reshaped), e) from e
    group.placer.release(list(unused) + unused_groups([group.pgs[q] for q in range(new.dp, old.dp)],
                                                      nxt.pgs.values()))
    moved = sum(sizes[i][new.coords(r).tp] for r in range(new.world_size) for i in range(old.tp)
                if not (r in plan.kept and i == r))
    return nxt, moved


def _rolled_back(group, plan, exported, reshaped):
    """The old layout again after a failed TP switch: the kept processes take back their old shards (or,
    if they are gone, start anew), the removed ranks start anew and rebuild theirs from what they exported."""
    refs, replicated, _ = exported
    lay = group.layout
    try:
        if reshaped:
            group.revert(reshaped)
        fresh = group.started(plan.removed)
        sources = {r: RebuildSource(tuple(refs[lay.coords(r).tp]), replicated[0]) for r in plan.removed}
        return fresh.join(setup=plan.removed, states=sources)
    except FAILURES:  # a kept process is lost too: everything starts anew from the exported bundles
        group.kill(range(lay.world_size))
        fresh = type(group).create(group.launcher, group.cfg, group.pgs)
        sources = {r: RebuildSource(tuple(refs[lay.coords(r).tp]), replicated[0]) for r in range(lay.world_size)}
        try:
            return fresh.join(setup=range(lay.world_size), states=sources)
        except FAILURES:
            return fresh


def switch_stages(group, new_cfg, reserved: tuple, early: dict, plan):
    """`group` at another number of stages (the same TP degree), keeping the processes of `plan.kept`
    (raytp.runtime.elastic.rank_plans.stage_resize_ranks; their placement groups stay): every old owner cuts its
    shard into one bundle per new stage (raytp.runtime.worker.transfer), kept processes reshape to
    their new stage from them and the others start (or started ahead, `early`) and fill theirs: (new
    group, bytes moved). On a failure after the export the old layout starts again from the bundles."""
    old, new = group.layout, new_cfg.layout
    new_pgs, requested, unused = reserved
    stages = new_stages(new_cfg)
    started = [a for a, _ in early.values()]
    try:
        refs, replicated, sizes = group.export_pieces(new.tp, stages=stages)
    except FAILURES as e:
        group.kill_actors(started)
        group.placer.release(requested)
        raise SwitchFailed(group, e) from e
    slot = lambda r: new.coords(r).tp * len(stages) + new.coords(r).pp  # noqa: E731
    owners = Ownership(old).parts
    try:
        group.kill(plan.removed)  # their names and bundles go to the new layout; their bundles stay in the store
        late = {r: group.start_worker(r, new_cfg, new_pgs) for r in plan.late}
        started += [a for a, _ in late.values()]
        news = {**late, **early}
        workers = [group.workers[r] if r in plan.kept else news[r][0] for r in range(new.world_size)]
        nxt = group.successor(new_cfg, new_pgs, workers, bundles={actor_id(a): k for a, k in news.values()})
        sources = {r: PiecesSource(tuple(refs[i][slot(r)] for i in range(owners)), new_cfg.model.vocab_size)
                   for r in range(new.world_size)}
        nxt = nxt.join(setup=[r for r in range(new.world_size) if r not in plan.kept], reshape=plan.kept,
                       states=sources)
        nxt.commit_reshape(plan.kept)
    except FAILURES as e:
        group.kill_actors(started)
        group.kill(range(old.world_size))
        group.placer.release(requested)
        raise SwitchFailed(restarted_from(group, refs, replicated), e) from e
    group.placer.release(unused)
    return nxt, sum(sizes[i][slot(r)] for r in range(new.world_size) for i in range(owners))


def new_stages(cfg) -> list:
    """The Stage of each pipeline stage of `cfg`'s layout ([None] at pp == 1: the whole model)."""
    p = cfg.parallel
    return [stage_of(model_args(cfg), p.pp, s, p.pp_virtual, p.pp_layers) for s in range(p.pp)]


def restarted_from(group, refs, replicated):
    """The old layout started again in its own placement from the bundles its owners exported (each old
    rank takes back the pieces its part gave away, and its stage's replicated tensors)."""
    lay = group.layout
    own = Ownership(lay)
    fresh = type(group).create(group.launcher, group.cfg, group.pgs)

    def source(r: int):
        part, at = own.part(r), lay.coords(r)
        return RebuildSource(tuple(refs[part]), replicated[own.part(lay.rank(tp=0, pp=at.pp))])
    try:
        return fresh.join(setup=range(lay.world_size), states={r: source(r) for r in range(lay.world_size)})
    except FAILURES:
        return fresh


def rejoined(group, rows=None):
    """The old layout's workers, wired again (the shards they hold are untouched; under zero 1 each takes
    back its AdamW rows from the bundles it cut, `rows`: Group.export_rows')."""
    try:
        group = group.join()
        if rows is not None:
            group.state_calls().take_rows({r: list(rows[0][r]) for r in range(group.layout.world_size)})
        return group
    except FAILURES:
        return group  # the next step fails and recovers
