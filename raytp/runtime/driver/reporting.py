"""What a run reports: the metrics.jsonl line of a step, the events that close a recovery or a resize.

Pure formatting plus one write to the run's log each; the driver decides when.
"""
from __future__ import annotations

import time

from raytp.parallel.layout import Layout
from raytp.runtime.records import Healing, Resizing


def layout_dict(lay: Layout) -> dict:
    return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp}


def step_record(rec: dict, all_ranks: list[dict], cfg, layout: Layout) -> dict:
    """metrics.jsonl's line for one step: rank 0's figures, the slowest reporting rank's time (the ranks
    meet in collectives every step, so any rank's step time is every rank's to within their skew)."""
    step_time = max(r["step_time_s"] for r in all_ranks)
    tokens_per_step = cfg.train.batch_size * cfg.model.block_size
    return {"step": rec["step"], "loss": rec["loss"], "lr": rec["lr"], "grad_norm": rec["grad_norm"],
            "tokens": tokens_per_step * (rec["step"] + 1), "step_time_s": step_time,
            "tokens_per_s": tokens_per_step / step_time, "comm_s": rec["comm_s"],
            "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "time": time.time()}


def recovered(log, say, h: Healing, step: int) -> None:
    """The first completed step after a recovery: how long it took, from where, what was lost."""
    seconds = time.perf_counter() - h.t0
    log.event("recovered", seconds=seconds, lost_steps=h.lost_steps, source=h.source, ranks=list(h.ranks),
              step=step, spares=list(h.spares))
    say(f"recovered in {seconds:.1f}s from {h.source}, {h.lost_steps} step(s) lost")


def resized(log, say, r: Resizing, step: int) -> None:
    """The first completed step after a resize: how long it took, how long training paused."""
    now = time.perf_counter()
    log.event("resized", old=layout_dict(r.old), new=layout_dict(r.new), seconds=now - r.t0,
              stall_s=now - r.switch_t0, bytes=r.bytes, lost_steps=0, step=step, reason=r.reason)
    if log.ray:
        log.ray.set("world_size", r.new.world_size)
    say(f"resized to {r.new} in {now - r.t0:.1f}s, training paused {now - r.switch_t0:.1f}s "
        f"({r.bytes / 1e6:.1f} MB moved)")


def closed(log, say, healing: Healing | None, resizing: Resizing | None, step: int) -> None:
    """The job went on after a recovery and/or a resize (whichever is given): log how long each took."""
    if healing is not None:
        recovered(log, say, healing, step)
    if resizing is not None:
        resized(log, say, resizing, step)


def interval_chosen(log, cadence, every: int, step: int, last: dict) -> None:
    """The snapshot interval the runtime chose (raytp.runtime.state.snapshots.Cadence), and from what."""
    log.event("snapshot_interval", every=every, step=step, budget=cadence.budget, pinned=cadence.pinned is not None,
              lost_steps_bound=every, copy_s=cadence.cost(), step_s=last.get("step_time_s"))
