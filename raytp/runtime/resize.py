"""Elastic resizing: a new TP x DP layout for a running job, at a step boundary, in memory.

- Two phases. On a request (``request``, from ``raytp scale`` through the
  control actor) new capacity is reserved first (placement groups for the
  replicas that are new or change shape); if it cannot be had in time the job
  goes on unchanged and the request is answered with the reason. Then the
  ranks whose actor names are free (R >= the old world size) are started, and
  the job *keeps training on the old layout* while their processes come up
  (python, torch: seconds), one step per call. At the first step boundary
  where they all answer, ``maybe_finish`` switches: the part below, the only
  time training pauses (``stall_s`` in the ``resized`` event; ``seconds`` is
  from the request). A shrink has nothing to start and switches at once.
  ``resize`` does both phases in one call (tests, benchmarks).
- A DP change keeps the staying replicas' workers and processes: removed
  replicas are stopped and their groups released, added replicas start and
  copy their shards from replica 0 through the object store.
- A TP change reshapes every TP group. The shards of replica 0 are gathered
  into the driver's memory and joined into the one-device state; every worker
  of the new layout then builds its shard empty (no seeded initialisation) and
  takes its slices of that state through the object store. Nothing touches
  the disk. Processes are kept where a rank keeps its number, its replica and
  its bundle: replica 0's first min(old, new) TP ranks (with DP=1, every worker
  that stays). They leave their groups and ``reshape`` in place; the others
  are stopped, and the added ranks start anew.
- Names. A worker's actor name is ``raytp.<run>.rank<R>`` with R its *current*
  rank (the promise of ../shared/INTERFACES.md): Ray actor names are immutable,
  so a process whose rank number would change (TP 2 -> 4 at DP=2: old rank 2,
  replica 1, would become rank 4) is not kept but replaced, which at DP > 1
  costs the process start of replicas 1.. (it overlaps the other starts).
  Ranks whose names are free (R >= the old world size) are started before the
  old layout is stopped, so their process start overlaps the state gathering
  and the stopping; the others start as soon as their old holder is gone.
- Placement. Ray cannot grow a placement group: a TP grow asks, for each
  replica that stays, for an extension group of the missing bundles aimed at
  the replica's node (``_soft_target_node_id``) and checks where it landed; if
  any landed on another node, the resize takes the full-restart path instead
  (new groups for every replica, every worker started anew). Added replicas
  get a new group of their own. A TP shrink asks for nothing: each replica
  keeps its groups, extension groups no longer used are released, and the
  bundles of its first group past the new degree stay reserved (idle) until
  the replica's group is released (a DP shrink, the end of the run); a later
  TP grow back reuses them without asking Ray. ``Driver.pgs`` maps dp_rank to
  the replica's placement: a plain group, or a ``placement.Slots``.
- The global batch stays the job's ``train.batch_size``: each replica's
  micro-batch stays the same and a smaller DP degree accumulates over more of
  them; data order and the LR schedule are functions of the step, so the run
  continues as if nothing happened (to floating-point tolerance).
- A resize that fails midway rolls back to the old layout. For a TP change
  that got past the gathering of the state, the old layout restarts from the
  state the driver holds: every worker of the new layout is stopped (kept ones
  too: they may be blocked in the failed rendezvous) and the old ranks start
  anew and take their slices of it.
"""
from __future__ import annotations

import dataclasses
import math
import time

import ray

from raytp import config as config_mod
from raytp.parallel.layout import Layout
from raytp.runtime import placement
from raytp.runtime.recovery import FAILURES
from raytp.runtime.snapshots import Snapshots
from raytp.runtime.worker import gpt_config
from raytp.train import checkpoint


def resized_config(cfg: config_mod.JobConfig, tp: int, dp: int) -> config_mod.JobConfig:
    """The job at layout tp x dp: same global batch, same micro-batch where it divides the new share."""
    local = cfg.train.batch_size // dp if cfg.train.batch_size % dp == 0 else cfg.train.batch_size
    micro = math.gcd(cfg.micro_batch, local)
    new = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, tp=tp, dp=dp),
        train=dataclasses.replace(cfg.train, micro_batch_size=micro))
    config_mod.validate(new, "scale request")
    return new


def state_bytes(state: dict) -> int:
    n = sum(t.numel() * t.element_size() for t in state["model"].values())
    return n + sum(t.numel() * t.element_size() for st in state["optim"].values() for t in st.values())


@dataclasses.dataclass
class Pending:
    """A requested resize whose new ranks are starting while the old layout trains on."""
    t0: float                 # the request (perf_counter)
    new_cfg: config_mod.JobConfig
    kind: str                 # "tp" or "dp"
    base: tuple               # the layout and groups it was planned against
    reserved: object          # what _finish_* needs of the placement
    requested: list           # placement groups asked for (released if it is cancelled)
    early: dict               # rank -> actor started ahead
    ready: list               # their pings
    request_id: int | None    # the control request to answer, if any


def _base(d) -> tuple:
    groups = [g.id.hex() for q in sorted(d.pgs) for g in placement.groups_of(d.pgs[q])]
    return d.layout.tp, d.layout.dp, tuple(groups)


def request(d, tp: int, dp: int, request_id: int | None = None) -> dict | None:
    """Begin moving driver `d` to layout tp x dp: validate, reserve the placement, start the ranks
    whose names are free (their processes come up while the old layout trains on). Returns the
    outcome at once if it is refused, failed, trivial or done; None if it waits for its new ranks
    (``maybe_finish`` completes it at a step boundary and answers `request_id`)."""
    t0 = time.perf_counter()
    old = d.layout
    if d.pending_resize is not None:
        new = d.pending_resize.new_cfg.parallel
        return {"ok": False, "error": f"a resize to TP={new.tp} x DP={new.dp} is in progress"}
    try:
        new_cfg = resized_config(d.cfg, tp, dp)
    except config_mod.ConfigError as e:
        return {"ok": False, "error": "; ".join(e.problems)}
    if (tp, dp) == (old.tp, old.dp):
        return {"ok": True, "layout": str(old), "note": "already at this layout"}
    d._say(f"resizing {old} -> TP={tp} x DP={dp} (requested at step {d.step})")
    try:
        if tp == old.tp:
            reserved, requested, early = _plan_dp(d, new_cfg)
        else:
            planned = _reserve_tp(d, new_cfg)
            if planned is None:  # an extension landed on another node than its replica
                d._say("more bundles could not be had on a replica's node: restarting every worker")
                moved = _resize_tp_restart(d, new_cfg)
                d.resizing = {"t0": t0, "switch_t0": t0, "old": {"tp": old.tp, "dp": old.dp},
                              "new": {"tp": tp, "dp": dp}, "bytes": moved, "reason": "requested"}
                return {"ok": True, "layout": str(d.layout), "bytes": moved, "step": d.step}
            reserved, requested = planned, planned[1]
            early = {r: d.new_worker(r, at=(new_cfg, planned[0]))
                     for r in range(old.world_size, new_cfg.world_size)}
    except placement.PlacementError as e:
        d.log.event("resize_refused", old={"tp": old.tp, "dp": old.dp}, new={"tp": tp, "dp": dp}, error=str(e))
        return {"ok": False, "error": str(e)}
    except FAILURES as e:
        return {"ok": False, "error": f"resize failed and was rolled back: {type(e).__name__}: {e}"}
    d.pending_resize = Pending(t0, new_cfg, "dp" if tp == old.tp else "tp", _base(d), reserved, requested, early,
                               [w.ping.remote() for w in early.values()], request_id if early else None)
    if not early:  # nothing to start (a shrink): switch at this step boundary
        return maybe_finish(d, wait=True)
    return None


def maybe_finish(d, wait: bool = False) -> dict | None:
    """At a step boundary: switch to the pending layout once its new ranks are up (or, with `wait`,
    now); returns the outcome (also sent to the request's asker), or None if it still waits."""
    p = d.pending_resize
    if p is None:
        return None
    if _base(d) != p.base:  # a failure was healed by shrinking meanwhile: the plan no longer fits
        return cancel(d, "the layout changed while its new workers started (a failure was healed)")
    if not wait and p.ready:
        up, _ = ray.wait(p.ready, num_returns=len(p.ready), timeout=0)
        if len(up) < len(p.ready) and time.perf_counter() - p.t0 < d.cfg.runtime.placement_timeout_s:
            return None  # not up yet; past the timeout the switch is tried anyway (and rolls back)
    d.pending_resize = None
    old, t_switch = d.layout, time.perf_counter()
    try:
        moved = (_resize_dp(d, p.new_cfg, p.reserved, p.early) if p.kind == "dp"
                 else _resize_tp(d, p.new_cfg, p.reserved, p.early))
    except FAILURES as e:
        outcome = {"ok": False, "error": f"resize failed and was rolled back: {type(e).__name__}: {e}"}
    else:
        new = p.new_cfg.parallel
        d.resizing = {"t0": p.t0, "switch_t0": t_switch, "old": {"tp": old.tp, "dp": old.dp},
                      "new": {"tp": new.tp, "dp": new.dp}, "bytes": moved, "reason": "requested"}
        outcome = {"ok": True, "layout": str(d.layout), "bytes": moved, "step": d.step}
    _answer(d, p, outcome)
    return outcome


def cancel(d, why: str) -> dict | None:
    """Drop a pending resize: its new ranks stop and its placement groups go; the job is untouched."""
    p, d.pending_resize = d.pending_resize, None
    if p is None:
        return None
    placement.kill(p.early.values())
    placement.release(p.requested)
    outcome = {"ok": False, "error": f"resize cancelled: {why}"}
    _answer(d, p, outcome)
    return outcome


def _answer(d, p: Pending, outcome: dict) -> None:
    if p.request_id is not None and d.control is not None:
        d.control.answer.remote(p.request_id, outcome)


def resize(d, tp: int, dp: int) -> dict:
    """Move driver `d` to layout tp x dp now (request, wait for the new ranks, switch); the outcome."""
    outcome = request(d, tp, dp)
    if outcome is not None:
        return outcome
    p = d.pending_resize
    if p.ready:
        ray.wait(p.ready, num_returns=len(p.ready), timeout=d.cfg.runtime.placement_timeout_s)
    return maybe_finish(d, wait=True)


def _switch(d, cfg, pgs: dict) -> None:
    d.cfg, d.layout, d.pgs = cfg, Layout(cfg.parallel.tp, cfg.parallel.dp), pgs
    d.snapshots = Snapshots(cfg.parallel.tp)


def maybe_grow(d) -> None:
    """After an elastic shrink: placement groups for the missing replicas are requested at once and
    left pending (the autoscaler sees the demand); at each step boundary, once they are all placed,
    the job grows back to its DP degree. Never blocks training."""
    if d.layout.dp >= d.target_dp:
        return
    tp, added = d.layout.tp, list(range(d.layout.dp, d.target_dp))
    if d.growing is None:
        pgs = placement.request_replicas(d.cfg, d.run, tp, added, avoid_nodes=placement.nodes_of(d.pgs))
        d.growing = (pgs, [pg.ready() for pg in pgs.values()])
        return
    pgs, ready_refs = d.growing
    ready, _ = ray.wait(ready_refs, num_returns=len(ready_refs), timeout=0)
    if len(ready) < len(ready_refs):
        return
    d.growing = None
    t0, old = time.perf_counter(), {"tp": tp, "dp": d.layout.dp}
    d._say(f"capacity is back: growing to TP={tp} x DP={d.target_dp}")
    try:
        moved = _resize_dp(d, resized_config(d.cfg, tp, d.target_dp), reserved=pgs)
    except FAILURES as e:
        d._say(f"growing back failed and was rolled back: {type(e).__name__}: {e}")
        return
    d.resizing = {"t0": t0, "old": old, "new": {"tp": tp, "dp": d.layout.dp}, "bytes": moved,
                  "reason": "capacity returned"}


def _plan_dp(d, new_cfg) -> tuple[dict, list, dict]:
    """A DP change's placement groups for the added replicas (reserved, waited for) and their ranks,
    started ahead (their names are free): (groups, groups, {rank: actor})."""
    tp, old_dp, new_dp = d.layout.tp, d.layout.dp, new_cfg.parallel.dp
    added = list(range(old_dp, new_dp))
    if not added:
        return {}, [], {}
    new_pgs = placement.reserve_replicas(new_cfg, d.run, tp, added, new_cfg.runtime.placement_timeout_s,
                                         avoid_nodes=placement.nodes_of(d.pgs))
    pgs = {**{r: pg for r, pg in d.pgs.items() if r < new_dp}, **new_pgs}
    return new_pgs, list(new_pgs.values()), {r: d.new_worker(r, at=(new_cfg, pgs))
                                             for r in range(old_dp * tp, new_dp * tp)}


def _resize_dp(d, new_cfg, reserved: dict | None = None, early: dict | None = None) -> int:
    old_cfg, old_pgs, old_workers = d.cfg, dict(d.pgs), list(d.workers)
    tp, old_dp, new_dp = d.layout.tp, d.layout.dp, new_cfg.parallel.dp
    added = list(range(old_dp, new_dp))
    new_pgs = reserved if reserved is not None else placement.reserve_replicas(
        new_cfg, d.run, tp, added, new_cfg.runtime.placement_timeout_s,
        avoid_nodes=placement.nodes_of(old_pgs)) if added else {}
    removed_pgs = [old_pgs[r] for r in range(new_dp, old_dp)]
    early = early or {}
    try:
        ray.get([w.leave_groups.remote() for w in old_workers], timeout=new_cfg.runtime.step_timeout_s)
        _switch(d, new_cfg, {**{r: pg for r, pg in old_pgs.items() if r < new_dp}, **new_pgs})
        keep = new_dp * tp if new_dp < old_dp else old_dp * tp
        d.workers = old_workers[:keep] + [early.get(r) or d.new_worker(r) for r in range(keep, new_dp * tp)]
        fresh = set(range(keep, new_dp * tp))
        d.wire(fresh, job=new_cfg.to_dict())
        # Added replicas copy their shards from replica 0 (same TP rank), worker to worker.
        donors = {r: d.workers[d.layout.coords(r)[1]] for r in fresh}
        ray.get([d.workers[r].set_shard.remote(donors[r].get_state.remote(), d.step) for r in fresh],
                timeout=new_cfg.runtime.step_timeout_s)
        moved = sum(ray.get([donors[r].state_nbytes.remote() for r in fresh]))
    except FAILURES:
        placement.kill(d.workers[min(new_dp, old_dp) * tp:] if new_dp > old_dp else [])
        placement.kill(early.values())
        placement.release(new_pgs.values())
        _switch(d, old_cfg, old_pgs)
        d.workers = old_workers
        d.wire(set(), job=old_cfg.to_dict())
        raise
    placement.kill(old_workers[new_dp * tp:])
    placement.release(removed_pgs)
    return moved


def _resize_tp(d, new_cfg, reserved: tuple, early: dict) -> int:
    """A TP change that keeps the processes of replica 0's first min(old, new) ranks (see above).
    `reserved`: _reserve_tp's placement; `early`: the ranks whose names were free, started ahead."""
    old_cfg, old = d.cfg, d.layout
    new = Layout(new_cfg.parallel.tp, new_cfg.parallel.dp)
    new_pgs, requested, unused = reserved
    old_pgs, old_workers, old_snapshots = dict(d.pgs), list(d.workers), d.snapshots
    timeout = new_cfg.runtime.step_timeout_s
    keep = min(old.tp, new.tp)  # same rank, name, replica and bundle at both layouts
    started: list = list(early.values())
    ref = None
    try:
        _switch(d, new_cfg, new_pgs)
        shards = ray.get([w.get_state.remote() for w in old_workers[:old.tp]], timeout=timeout)
        full = checkpoint.unshard_state(shards, gpt_config(old_cfg))
        del shards
        ref = ray.put(full)
        placement.kill(old_workers[keep:])  # their names and bundles go to the new layout
        late = [d.new_worker(r) for r in range(keep, min(old.world_size, new.world_size))]
        started += late
        d.workers = old_workers[:keep] + late + [early[r] for r in sorted(early)]
        d.wire(set(range(keep, new.world_size)), job=new_cfg.to_dict(), full=ref)
    except FAILURES:
        placement.kill(started)
        placement.release(requested)
        _switch(d, old_cfg, old_pgs)
        if ref is None:  # the old layout was not touched: it goes on as it was
            d.workers, d.snapshots = old_workers, old_snapshots
            raise
        placement.kill(old_workers[:keep])
        d.workers = [d.new_worker(r) for r in range(old.world_size)]
        d.wire(set(range(old.world_size)), job=old_cfg.to_dict(), full=ref)
        raise
    placement.release(unused + [old_pgs[q] for q in range(new.dp, old.dp)])
    return state_bytes(full)


def _reserve_tp(d, new_cfg):
    """The placement of layout new_cfg for a TP change that keeps replica 0's processes:
    (dp_rank -> placement, groups requested, groups no longer used once it is done), or None if an
    extension group could not be had on its replica's node (nothing is left reserved then).
    Raises PlacementError (leaving nothing behind) if the capacity is not there in time."""
    tp, dp, old_dp = new_cfg.parallel.tp, new_cfg.parallel.dp, d.layout.dp
    pgs, unused, ext = {}, [], {}
    for q in range(min(dp, old_dp)):
        have = placement.size_of(d.pgs[q])
        if have >= tp:
            pgs[q], spare = placement.trimmed(d.pgs[q], tp)
            unused += spare
        else:
            ext[q] = placement.request_extension(new_cfg, d.run, q, d.pgs[q], tp - have)
    added = placement.request_replicas(new_cfg, d.run, tp, list(range(old_dp, dp)),
                                       avoid_nodes=placement.nodes_of(d.pgs)) if dp > old_dp else {}
    requested = [pg for pg, _ in ext.values()] + list(added.values())
    timeout = new_cfg.runtime.placement_timeout_s
    if requested:
        ready, _ = ray.wait([pg.ready() for pg in requested], num_returns=len(requested), timeout=timeout)
        if len(ready) < len(requested):
            placement.release(requested)
            raise placement.PlacementError(f"could not place the workers within {timeout:g}s: "
                                           + placement.explain_shortfall(new_cfg, tp, dp))
    if not all(placement.extension_placed(pg, node) for pg, node in ext.values()):
        placement.release(requested)
        return None
    for q, (pg, _) in ext.items():
        pgs[q] = placement.extended(d.pgs[q], pg, tp - placement.size_of(d.pgs[q]))
    return {**pgs, **added}, requested, unused


def _resize_tp_restart(d, new_cfg) -> int:
    """A TP change the plain way: new placement groups for every replica, every worker started anew."""
    new = Layout(new_cfg.parallel.tp, new_cfg.parallel.dp)
    new_pgs = placement.reserve_replicas(new_cfg, d.run, new.tp, list(range(new.dp)),
                                         new_cfg.runtime.placement_timeout_s)
    old_cfg, old_pgs = d.cfg, dict(d.pgs)
    try:
        full = checkpoint.unshard_state(d.shard_states(), gpt_config(old_cfg))
        ref = ray.put(full)
    except FAILURES:
        placement.release(new_pgs.values())
        raise
    placement.kill(d.workers)  # the new ranks take the old names
    try:
        _switch(d, new_cfg, new_pgs)
        d.workers = [d.new_worker(r) for r in range(new.world_size)]
        d.wire(set(range(new.world_size)), full=ref)
    except FAILURES:  # back to the old layout, from the state the driver holds
        placement.kill(d.workers)
        placement.release(new_pgs.values())
        _switch(d, old_cfg, old_pgs)
        d.workers = [d.new_worker(r) for r in range(d.layout.world_size)]
        d.wire(set(range(d.layout.world_size)), full=ref)
        raise
    placement.release(old_pgs.values())
    return state_bytes(full)


def resized(d) -> None:
    """The first completed step after a resize: log it."""
    r, d.resizing = d.resizing, None
    seconds = time.perf_counter() - r["t0"]
    stall = time.perf_counter() - r.get("switch_t0", r["t0"])
    d.log.event("resized", old=r["old"], new=r["new"], seconds=seconds, stall_s=stall, bytes=r["bytes"],
                lost_steps=0, step=d.step, reason=r["reason"])
    if d.log.ray:
        d.log.ray.set("world_size", d.layout.world_size)
    d._say(f"resized to {d.layout} in {seconds:.1f}s, training paused {stall:.1f}s "
           f"({r['bytes'] / 1e6:.1f} MB moved)")
