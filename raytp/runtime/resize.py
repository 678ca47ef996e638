"""Elastic resizing: a new TP x DP layout for a running job, at a step boundary, in memory.

- New capacity is reserved first (placement groups for the replicas that
  are new or change shape); if it cannot be had in time the job goes on
  unchanged and the request is answered with the reason.
- A DP change keeps the staying replicas' workers and processes: removed
  replicas are stopped and their groups released, added replicas start and
  copy their shards from replica 0 through the object store.
- A TP change reshapes every TP group, so every replica's placement group
  changes shape (a TP group lives in one group, on one node): the shards of
  replica 0 are gathered into the driver's memory, joined into the one-device
  state, and each new worker takes its slices of it through the object store.
  Nothing touches the disk.
- The global batch stays the job's ``train.batch_size``: each replica's
  micro-batch stays the same and a smaller DP degree accumulates over more of
  them; data order and the LR schedule are functions of the step, so the run
  continues as if nothing happened (to floating-point tolerance).
- A resize that fails midway rolls back to the old layout.
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


def resize(d, tp: int, dp: int) -> dict:
    """Move driver `d` to layout tp x dp; returns the outcome ({"ok": ..., "error" or figures})."""
    t0 = time.perf_counter()
    old = d.layout
    try:
        new_cfg = resized_config(d.cfg, tp, dp)
    except config_mod.ConfigError as e:
        return {"ok": False, "error": "; ".join(e.problems)}
    if (tp, dp) == (old.tp, old.dp):
        return {"ok": True, "layout": str(old), "note": "already at this layout"}
    d._say(f"resizing {old} -> TP={tp} x DP={dp} at step {d.step}")
    try:
        moved = (_resize_dp if tp == old.tp else _resize_tp)(d, new_cfg)
    except placement.PlacementError as e:
        d.log.event("resize_refused", old={"tp": old.tp, "dp": old.dp}, new={"tp": tp, "dp": dp}, error=str(e))
        return {"ok": False, "error": str(e)}
    except FAILURES as e:
        return {"ok": False, "error": f"resize failed and was rolled back: {type(e).__name__}: {e}"}
    d.resizing = {"t0": t0, "old": {"tp": old.tp, "dp": old.dp}, "new": {"tp": tp, "dp": dp}, "bytes": moved,
                  "reason": "requested"}
    return {"ok": True, "layout": str(d.layout), "bytes": moved, "step": d.step}


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


def _resize_dp(d, new_cfg, reserved: dict | None = None) -> int:
    old_cfg, old_pgs, old_workers = d.cfg, dict(d.pgs), list(d.workers)
    tp, old_dp, new_dp = d.layout.tp, d.layout.dp, new_cfg.parallel.dp
    added = list(range(old_dp, new_dp))
    new_pgs = reserved if reserved is not None else placement.reserve_replicas(
        new_cfg, d.run, tp, added, new_cfg.runtime.placement_timeout_s,
        avoid_nodes=placement.nodes_of(old_pgs)) if added else {}
    removed_pgs = [old_pgs[r] for r in range(new_dp, old_dp)]
    try:
        ray.get([w.leave_groups.remote() for w in old_workers], timeout=new_cfg.runtime.step_timeout_s)
        _switch(d, new_cfg, {**{r: pg for r, pg in old_pgs.items() if r < new_dp}, **new_pgs})
        keep = new_dp * tp if new_dp < old_dp else old_dp * tp
        d.workers = old_workers[:keep] + [d.new_worker(r) for r in range(keep, new_dp * tp)]
        fresh = set(range(keep, new_dp * tp))
        d.wire(fresh, job=new_cfg.to_dict())
        # Added replicas copy their shards from replica 0 (same TP rank), worker to worker.
        donors = {r: d.workers[d.layout.coords(r)[1]] for r in fresh}
        ray.get([d.workers[r].set_shard.remote(donors[r].get_state.remote(), d.step) for r in fresh],
                timeout=new_cfg.runtime.step_timeout_s)
        moved = sum(ray.get([donors[r].state_nbytes.remote() for r in fresh]))
    except FAILURES:
        _kill(d.workers[min(new_dp, old_dp) * tp:] if new_dp > old_dp else [])
        placement.release(new_pgs.values())
        _switch(d, old_cfg, old_pgs)
        d.workers = old_workers
        d.wire(set(), job=old_cfg.to_dict())
        raise
    _kill(old_workers[new_dp * tp:])
    placement.release(removed_pgs)
    return moved


def _resize_tp(d, new_cfg) -> int:
    new = Layout(new_cfg.parallel.tp, new_cfg.parallel.dp)
    new_pgs = placement.reserve_replicas(new_cfg, d.run, new.tp, list(range(new.dp)),
                                         new_cfg.runtime.placement_timeout_s)
    old_cfg, old_pgs = d.cfg, dict(d.pgs)
    try:
        full = checkpoint.unshard_state(d.shard_states(), gpt_config(old_cfg))
    except FAILURES:
        placement.release(new_pgs.values())
        raise
    _kill(d.workers)  # the new ranks take the old names
    try:
        _switch(d, new_cfg, new_pgs)
        d.workers = [d.new_worker(r) for r in range(new.world_size)]
        d.wire(set(range(new.world_size)))
        d.set_state(full)
    except FAILURES:  # back to the old layout, from the state the driver holds
        _kill(d.workers)
        placement.release(new_pgs.values())
        _switch(d, old_cfg, old_pgs)
        d.workers = [d.new_worker(r) for r in range(d.layout.world_size)]
        d.wire(set(range(d.layout.world_size)))
        d.set_state(full)
        raise
    placement.release(old_pgs.values())
    return state_bytes(full)


def _kill(workers) -> None:
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def resized(d) -> None:
    """The first completed step after a resize: log it."""
    r, d.resizing = d.resizing, None
    seconds = time.perf_counter() - r["t0"]
    d.log.event("resized", old=r["old"], new=r["new"], seconds=seconds, bytes=r["bytes"], lost_steps=0,
                step=d.step, reason=r["reason"])
    if d.log.ray:
        d.log.ray.set("world_size", d.layout.world_size)
    d._say(f"resized to {d.layout} in {seconds:.1f}s ({r['bytes'] / 1e6:.1f} MB moved)")
