"""moe_memory: what an MoE Llama's rank holds, measured, against the job's memory estimate (raytp.runtime.estimate).

Gloo ranks build their shard as a worker does (raytp.runtime.worker.held_shard.HeldShard.build, from a job
config) and train two steps. Per rank, two figures against the estimate of the same job:

- state: the storage bytes of its weights, gradients (with the flat buffers of their DP and expert-DP sums,
  which the distributed optimizer keeps from the reduce to the update) and AdamW moments, at their largest in
  a step (as each reduction's buffers come back, and right before the update), against the estimate's
  weights + grads + AdamW;
- peak RSS growth of the rank's process (``VmHWM``, reset after a one-step run at a tiny size has touched
  torch's kernels) from before the shard is built to the end of the steps, against the estimate's whole per-device figure (state + activations);
  the allocator keeps freed pages and the first steps allocate more than the later ones, so this one is
  read as an upper bound.

Layouts: TP=1 x DP=2 x EP=2 at zero 0 and zero 1 (dense AdamW rows cut over DP, each rank's experts whole),
TP=2 x EP=2 with etp 1 (the experts over the TP ranks, each expert whole), and on 4 ranks TP=1 x DP=4 x EP=2
at zero 1 (an expert-DP group of two: the experts' AdamW rows cut over it). Goal: the state within 10% of
the estimate.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from bench.common import spawn
from bench.memory import held_bytes

PEER = "raytp.runtime.estimate for the same job (weights + grads + AdamW; and the per-device figure for RSS)"
FULL = {"n_layer": 4, "n_embd": 256, "moe_ffn": 512, "n_experts": 8, "block_size": 128, "batch": 8}
QUICK = {"n_layer": 2, "n_embd": 64, "moe_ffn": 64, "n_experts": 4, "block_size": 32, "batch": 4}
LAYOUTS = {"dp2_ep2_zero0": {"tp": 1, "dp": 2, "ep": 2, "zero": 0},
           "dp2_ep2_zero1": {"tp": 1, "dp": 2, "ep": 2, "zero": 1},
           "tp2_ep2_etp1": {"tp": 2, "dp": 1, "ep": 2, "etp": 1},
           "dp4_ep2_zero1": {"tp": 1, "dp": 4, "ep": 2, "zero": 1}}
GOAL = 0.10


def job(s: dict, parallel: dict):
    from raytp.config import from_dict
    return from_dict({
        "model": {"arch": "llama", "n_layer": s["n_layer"], "n_head": 4, "n_kv_head": 2, "n_embd": s["n_embd"],
                  "intermediate_size": 2 * s["moe_ffn"], "block_size": s["block_size"], "vocab_size": 512,
                  "moe": {"n_experts": s["n_experts"], "top_k": 2, "moe_ffn": s["moe_ffn"], "aux_coeff": 0.01}},
        "parallel": parallel, "train": {"batch_size": s["batch"] * parallel.get("dp", 1), "precision": "fp32"},
        "recovery": {"snapshot_every": 0}, "runtime": {"device": "cpu"}})


def _kb(field: str) -> int:
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_state(shard) -> dict:
    """Watch the shard's gradient buckets: the largest state bytes seen as a step's sums come back (every
    gradient, and every buffer of the DP or expert-DP reduction, alive), or right before the update."""
    peak = {"total": 0}

    def seen(extra=()) -> None:
        now = held_bytes(shard.model, shard.optimizer)
        now["grads"] += sum(f.untyped_storage().nbytes() for f in extra)
        now["total"] += sum(f.untyped_storage().nbytes() for f in extra)
        if now["total"] > peak["total"]:
            peak.clear()
            peak.update(now)

    def watched(finish):
        def call(group):
            flats = finish(group)
            seen(flats)
            return flats
        return call
    for buckets in (shard.optimizer.grads, shard.optimizer.apart):
        if buckets is not None:
            buckets.finish = watched(buckets.finish)
    return peak, seen


def _train(cfg, groups, rank: int, steps: int = 2) -> dict:
    from raytp.runtime.worker.held_shard import HeldShard
    from raytp.train.step import train_step
    shard = HeldShard.build(cfg, groups, torch.device("cpu"), None, {})
    peak, seen = _peak_state(shard)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randint(0, cfg.model.vocab_size, (cfg.micro_batch, cfg.model.block_size), generator=gen)
        y = torch.randint(0, cfg.model.vocab_size, (cfg.micro_batch, cfg.model.block_size), generator=gen)
        train_step(shard.model, shard.optimizer, [(x, y)], groups, step, shard.hyper, before_update=seen)
    return peak


def _rank(rank: int, world: int, init: str, s: dict, parallel: dict) -> dict:
    from raytp.parallel.groups import build_groups
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cfg = job(s, parallel)
    groups = build_groups(cfg.layout, rank)
    _train(job(QUICK, parallel), groups, rank, 1)  # torch's kernels and autograd touched once, at a tiny size
    with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now
    before = _kb("VmHWM")
    state = _train(cfg, groups, rank)
    return {"state": state, "rss_growth": _kb("VmHWM") - before}


def run(quick: bool = False) -> dict:
    from raytp.runtime.estimate import estimate
    s = QUICK if quick else FULL
    out: dict = {"peer": PEER, "size": s, "goal": f"state within {GOAL:.0%} of the estimate"}
    for name, parallel in LAYOUTS.items():
        est = estimate(job(s, parallel))
        ranks = spawn(parallel.get("tp", 1) * parallel.get("dp", 1), _rank, s, parallel)
        worst = max(ranks, key=lambda r: r["state"]["total"])
        state = est.weights + est.grads + est.optimizer
        out[name] = {
            "state_bytes": worst["state"]["total"], "estimate_state_bytes": state,
            "state_over_estimate": round(worst["state"]["total"] / state, 4),
            "measured": {k: worst["state"][k] for k in ("params", "grads", "optimizer")},
            "estimated": {"params": est.weights, "grads": est.grads, "optimizer": est.optimizer},
            "rss_growth_bytes": max(r["rss_growth"] for r in ranks), "estimate_on_device_bytes": est.on_device,
            "rss_over_estimate": round(max(r["rss_growth"] for r in ranks) / est.on_device, 4),
        }
    out["within_goal"] = all(abs(v["state_over_estimate"] - 1) <= GOAL for k, v in out.items() if k in LAYOUTS)
    return out


if __name__ == "__main__":
    import json
    print(json.dumps(run(quick=bool(os.environ.get("QUICK"))), indent=2))
