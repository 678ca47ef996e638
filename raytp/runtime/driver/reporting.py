"""What a run reports: the metrics.jsonl line of a step, the events that close a recovery or a resize.

Pure formatting plus one write to the run's log each; the driver decides when.
"""
from __future__ import annotations

import time

from raytp.config.adapters import model_args
from raytp.parallel.layout import Layout
from raytp.runtime import estimate, spread
from raytp.runtime.driver import watches
from raytp.train import efficiency
from raytp.runtime.records import Healing, Moving, Resizing, layout_dict


def step_record(rec: dict, all_ranks: list[dict], cfg, layout: Layout) -> dict:
    """metrics.jsonl's line for one step: rank 0's figures, the slowest reporting rank's time (the ranks
    meet in collectives every step, so any rank's step time is every rank's to within their skew), their
    TFLOP/s per device and MFU (raytp.train.efficiency; MFU where the device's peak is known), the step's
    slowest rank by compute time (raytp.runtime.driver.watches), and the highest peak memory and data
    time of the reporting ranks."""
    step_time = max(r["step_time_s"] for r in all_ranks)
    tokens_per_step = cfg.train.batch_size * cfg.model.block_size
    out = {"step": rec["step"], "loss": rec["loss"], "lr": rec["lr"], "grad_norm": rec["grad_norm"],
           "tokens": tokens_per_step * (rec["step"] + 1), "step_time_s": step_time,
           "tokens_per_s": tokens_per_step / step_time, "comm_s": rec["comm_s"],
           "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "time": time.time()}
    if rec.get("comm_hidden_s") is not None:  # TP entries' collectives behind compute (parallel.tp_overlap)
        out["comm_hidden_s"] = rec["comm_hidden_s"]
    out.update(efficiency.step_figures(model_args(cfg), out["tokens_per_s"], layout.world_size, rec.get("peak_tflops")))
    if rec.get("loss_tokens") is not None:  # the targets the loss is over (conversations: the trained ones)
        out["loss_tokens"] = rec["loss_tokens"]
    if rec.get("epoch") is not None:
        out["epoch"] = round(rec["epoch"], 6)  # epochs of the training data read (raytp.data.corpus.epochs_read)
    straggler = watches.slowest(rec.get("rank_compute_s") or [])
    if straggler is not None:
        out["straggler"] = straggler
    for key in ("experts", "expert_imbalance", "balance_loss", "z_loss"):  # expert layers (raytp.train.expert_load)
        if rec.get(key) is not None:
            out[key] = rec[key]
    for key in ("data_s", "peak_mem_bytes", "alloc_retries"):
        got = [r[key] for r in all_ranks if r.get(key) is not None]
        if got:
            out[key] = max(got)
    return out


def unread_steps(log, kept: tuple, step: int, resumed: int, cfg, layout: Layout) -> None:
    """After a recovery: log the records of the steps the survivors finished but the driver never read
    (`kept`: (rank, record) of each, from raytp.runtime.cluster.health.kept_records), steps `step` ..
    `resumed`-1 of the job's curve, and an event naming where each came from (and any found nowhere)."""
    if resumed <= step:
        return
    for _, rec in kept:
        log.metric(step_record(rec, [rec], cfg, layout), rec.get("rank_compute_s"))
    found = {rec["step"]: rank for rank, rec in kept}
    log.event("records_recovered", steps=sorted(found), from_ranks=[found[s] for s in sorted(found)],
              missing=[s for s in range(step, resumed) if s not in found])


def survival(log, say, layout: Layout, nodes: list, placement, copy_node: str | None) -> None:
    """Once placed: which single node losses the job survives without a checkpoint (its replicas' nodes,
    the snapshots' off-node copy: raytp.runtime.spread.node_losses), as an event and a line."""
    losses = spread.node_losses(layout, nodes, copy_node)
    if not losses:
        return
    by_replica = spread.node_losses(layout, nodes)
    names = {p.get("node_id"): p.get("ip") or p.get("node_id") for p in placement if p.get("node_id")}
    log.event("survival", nodes=losses, replicas=by_replica, copy_node=copy_node)
    say(f"node loss: {spread.survival_line(losses, names, by_replica)}")


def started(log, say, run: str, cfg) -> None:
    lay = cfg.layout
    log.event("started", run=run, tp=lay.tp, dp=lay.dp, world_size=lay.world_size, device=cfg.runtime.device,
              steps=cfg.train.steps)
    say(f"placing {lay.world_size} workers ({lay}) ...")


def placed(say, cfg, placement) -> None:
    """Where a MoE job's experts run (rank 0's grouped GEMM or loop: raytp.models.moe.grouped)."""
    if cfg.model.moe is not None and placement and "experts" in placement[0]:
        say(f"experts: {placement[0]['experts']} on rank 0's device")


def resumed(log, say, step: int, source: str) -> None:
    log.event("resumed", step=step, source=source)
    say(f"starting at step {step} from {source}")


def first_step(log, say, cfg, rec: dict, seconds: float, est=None) -> None:
    """The first completed step: when, and the memory a worker measured at its peak against the start line's
    estimate (`est`, else raytp.runtime.estimate's of `cfg`: host memory on a CPU, the device's on a GPU)."""
    log.event("first_step", seconds=seconds)
    measured = rec.get("peak_mem_bytes")
    if measured is None:
        return
    est = est if est is not None else estimate.estimate(cfg)
    expected = est.on_device if cfg.runtime.device == "cuda" else est.on_host
    log.event("memory", measured_peak_bytes=measured, estimate_bytes=expected, ratio=measured / expected,
              where="device" if cfg.runtime.device == "cuda" else "host")
    say(f"memory: measured peak {measured / estimate.GiB:,.2f} GiB per worker "
        f"(estimated {expected / estimate.GiB:,.2f} GiB)")


def recovered(log, say, h: Healing, step: int, rec: dict) -> None:
    """The first completed step after a recovery (`rec`, its metrics line): how long training paused as the user
    saw it (``seconds``: from the last step's record before the failure to this one's, the gap metrics.jsonl
    shows; from the failure seen where no step came before), and its parts: ``detect_s`` (from that record to
    the failure seen), ``recovery_s`` (from then to this step's end); from where; what was lost."""
    now = time.perf_counter()
    recovery_s = now - h.t0
    seconds, detect = recovery_s, None
    if h.before is not None and h.seen is not None:
        detect = max(h.seen - h.before, 0.0)
        seconds = (rec["time"] - h.before) if rec.get("time") is not None else detect + recovery_s
    log.event("recovered", seconds=seconds, detect_s=detect, recovery_s=recovery_s, lost_steps=h.lost_steps,
              source=h.source, ranks=list(h.ranks), step=step, spares=list(h.spares))
    seen = f"; failure seen {detect:.1f}s after the last step" if detect is not None else ""
    say(f"recovered in {seconds:.1f}s (step to step{seen}) from {h.source}, {h.lost_steps} step(s) lost")


def paused_for(before: float | None, started: float, rec: dict) -> float:
    """How long training paused, as metrics.jsonl's times show it: the read time of the first step after
    the pause (`rec`), less its own step time, less the last one's read time (`before`); from `started`
    (perf_counter) to now where either is missing."""
    if before is not None and rec.get("time") is not None and rec.get("step_time_s") is not None:
        return max(rec["time"] - rec["step_time_s"] - before, 0.0)
    return time.perf_counter() - started


def resized(log, say, r: Resizing, step: int, rec: dict) -> None:
    """The first completed step after a resize: how long it took, and how long training paused: the gap
    between the last step before it and this one (`rec`), as metrics.jsonl's times show it (this step's
    read time, less its own step time, less the last one's read time); ``switch_s``: from the start of the
    switch to this step's end."""
    now = time.perf_counter()
    switch_s = now - r.switch_t0
    paused = paused_for(r.before, r.switch_t0, rec)
    log.event("resized", old=layout_dict(r.old), new=layout_dict(r.new), seconds=now - r.t0, stall_s=paused,
              switch_s=switch_s, bytes=r.bytes, lost_steps=0, step=step, reason=r.reason)
    if log.ray:
        log.ray.set("world_size", r.new.world_size)
    say(f"resized to {r.new} in {now - r.t0:.1f}s, training paused {paused:.1f}s "
        f"({r.bytes / 1e6:.1f} MB moved)")


def moved(log, say, m: Moving, step: int, rec: dict) -> None:
    """The first completed step after a stage moved off its twin's node: how long training paused."""
    paused = paused_for(m.before, m.t0, rec)
    log.event("moved", ranks=list(m.ranks), from_node=m.from_node, to_node=m.to_node, reason=m.reason,
              seconds=time.perf_counter() - m.t0, stall_s=paused, lost_steps=0, step=step)
    say(f"moved ranks {list(m.ranks)} to node {m.to_node}: training paused {paused:.1f}s, 0 steps lost")


def closed(log, say, healing: Healing | None, resizing: Resizing | None, step: int, rec: dict,
           moving: Moving | None = None) -> None:
    """The job went on after a recovery, a resize and/or a move (whichever is given): log how long each
    took. `rec`: the metrics line of the first step after it."""
    if healing is not None:
        recovered(log, say, healing, step, rec)
    if resizing is not None:
        resized(log, say, resizing, step, rec)
    if moving is not None:
        moved(log, say, moving, step, rec)


def interval_chosen(log, cadence, every: int, step: int, last: dict) -> None:
    """The snapshot interval the runtime chose (raytp.runtime.state.snapshots.Cadence), and from what."""
    log.event("snapshot_interval", every=every, step=step, budget=cadence.budget, pinned=cadence.pinned is not None,
              lost_steps_bound=every, copy_s=cadence.cost(), step_s=last.get("step_time_s"))
