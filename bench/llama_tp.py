"""llama_tp: step time of raytp's Llama TP vs the tensor parallelism transformers ships (``tp_plan``).

The same LlamaForCausalLM (built by transformers, saved, grouped-query
attention) at the same TP degree, in one spawned gloo process group (one
thread per rank, world size = TP):

- ``raytp``: each rank reads its slices of the saved directory
  (raytp.files.interop.hf.load_into) into raytp's Llama shard, and trains with
  raytp.train.step.train_step;
- ``transformers``: ``LlamaForCausalLM.from_pretrained(DIR, tp_plan="auto")``
  (transformers' own Colwise/Rowwise DTensor plan), trained by the same maths:
  cross entropy of its (gathered) logits against the same targets, backward,
  torch's clip_grad_norm_, AdamW with the same groups and knobs;
- ``raytp_bf16``: raytp with train.precision bf16 (its step time and TP bytes
  per step, reported beside fp32's);
- ``raytp_no_overlap``: raytp with ``parallel.tp_overlap`` off (each TP entry's
  backward all-reduce after the weight gradients, not behind them); raytp's
  exposed and hidden collective time per step with and without it.

They take turns step by step, in orders cycling through every permutation,
after untimed warm-up steps whose losses are compared (the two fp32 ones start
from the same weights and batches). A step's time is the max over ranks (ranks
start each step at a barrier). Figures: medians, their ratio, the median of
paired ratios, and the collectives and bytes one step issues.
"""
from __future__ import annotations

import itertools
import os
import statistics
import tempfile
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import HYPER, collective_counter, spawn, timed
from raytp.parallel import comm
from raytp.parallel.groups import build_groups
from raytp.parallel.layers import set_tp_overlap
from raytp.parallel.layout import Layout
from raytp.models.shard import build_empty_shard
from raytp.files.interop import hf
from raytp.data.corpus import batch
from raytp.train.hyper import lr_at
from raytp.train.step import make_optimizer, train_step

IMPLS = ("raytp", "transformers", "raytp_bf16", "raytp_no_overlap")
PEER = "transformers' tensor parallelism (LlamaForCausalLM.from_pretrained(tp_plan='auto'), DTensor), gloo, 1 thread/rank"
FULL = {"layers": 4, "width": 256, "heads": 8, "kv": 2, "ffn": 688, "vocab": 2048, "T": 128, "batch": 8,
        "warmup": 3, "timed": 30, "tps": (2,)}
QUICK = {"layers": 2, "width": 64, "heads": 8, "kv": 2, "ffn": 96, "vocab": 256, "T": 32, "batch": 4,
         "warmup": 2, "timed": 3, "tps": (2,)}


def _hf_dir(s: dict) -> str:
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["width"], intermediate_size=s["ffn"],
                                   num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                   num_key_value_heads=s["kv"], max_position_embeddings=s["T"],
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    d = tempfile.mkdtemp(prefix="raytp-bench-llama-")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _hf_optimizer(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": HYPER.weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), foreach=False)


def _hf_step(model, opt, x, y, step: int) -> float:
    model.train()
    opt.zero_grad(set_to_none=True)
    logits = model(x).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    from torch.distributed.tensor.experimental import implicit_replication
    with implicit_replication():  # the RMSNorm weights are plain (replicated) tensors, the rest DTensors
        torch.nn.utils.clip_grad_norm_(model.parameters(), HYPER.grad_clip)
    for g in opt.param_groups:
        g["lr"] = lr_at(step, HYPER)
    opt.step()
    return float(loss.detach())


def _rank(rank: int, world: int, init: str, d: str, s: dict, data) -> dict:
    import transformers
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = build_groups(Layout(world, dp=1), rank)
    models, opts = {}, {}
    for impl, h in (("raytp", HYPER), ("raytp_bf16", replace(HYPER, precision="bf16")), ("raytp_no_overlap", HYPER)):
        m = build_empty_shard(hf.inspect(d), groups.tp)
        hf.load_into(d, m, rank, world)
        set_tp_overlap(m, impl != "raytp_no_overlap")
        models[impl], opts[impl] = (m, h), make_optimizer(m, h)
    models["transformers"] = transformers.LlamaForCausalLM.from_pretrained(d, tp_plan="auto")
    opts["transformers"] = _hf_optimizer(models["transformers"])
    next_step = dict.fromkeys(IMPLS, 0)

    def step(impl: str) -> float:
        i = next_step[impl]
        next_step[impl] += 1
        x, y = data[i]
        if impl == "transformers":
            return _hf_step(models[impl], opts[impl], x, y, i)
        m, h = models[impl]
        return train_step(m, opts[impl], [(x, y)], groups, i, h).loss

    out = {impl: {"losses": [], "times": [], "counts": {}, "bytes": {}, "comm": []} for impl in IMPLS}
    for impl in IMPLS:
        for _ in range(s["warmup"]):
            out[impl]["losses"].append(step(impl))
        with collective_counter() as ops:  # one counted step, untimed
            out[impl]["losses"].append(step(impl))
        out[impl]["counts"], out[impl]["bytes"] = dict(ops.counts), dict(ops.bytes)
    orders = list(itertools.permutations(IMPLS))
    for i in range(s["timed"]):
        for impl in orders[i % len(orders)]:
            comm.STATS.take(), comm.STATS.take_hidden()
            seconds, loss = timed(lambda: step(impl))
            out[impl]["times"].append(seconds)
            out[impl]["losses"].append(loss)
            out[impl]["comm"].append((comm.STATS.take()[0], comm.STATS.take_hidden()))
    return out


def measure(tp: int, s: dict, d: str, data) -> dict:
    ranks = spawn(tp, _rank, d, s, data)
    per_step = {impl: [max(t) for t in zip(*(r[impl]["times"] for r in ranks))] for impl in IMPLS}
    fig: dict = {f"{impl}_median_step_s": round(statistics.median(per_step[impl]), 4) for impl in IMPLS}
    fig["ratio_raytp_over_transformers"] = round(fig["raytp_median_step_s"] / fig["transformers_median_step_s"], 3)
    fig["paired_ratio_median"] = round(statistics.median(
        a / b for a, b in zip(per_step["raytp"], per_step["transformers"])), 3)
    for impl in ("raytp", "raytp_no_overlap"):  # rank 0's collective seconds a step: waited on, run behind compute
        fig[f"{impl}_comm_exposed_s"] = round(statistics.median(c for c, _ in ranks[0][impl]["comm"]), 4)
        fig[f"{impl}_comm_hidden_s"] = round(statistics.median(h for _, h in ranks[0][impl]["comm"]), 4)
    fig["ratio_overlap_over_no_overlap"] = round(fig["raytp_median_step_s"] / fig["raytp_no_overlap_median_step_s"], 3)
    fig["ratio_bf16_over_fp32"] = round(fig["raytp_bf16_median_step_s"] / fig["raytp_median_step_s"], 3)
    n = s["warmup"] + 1
    a, b = ranks[0]["raytp"]["losses"][:n], ranks[0]["transformers"]["losses"][:n]
    fig["first_losses"] = {impl: [round(v, 5) for v in ranks[0][impl]["losses"][:n]] for impl in IMPLS}
    fig["first_losses_max_abs_diff_raytp_vs_transformers"] = float(f"{max(abs(u - v) for u, v in zip(a, b)):.2e}")
    fig["collectives_per_step"] = {impl: ranks[0][impl]["counts"] for impl in IMPLS}
    fig["collective_bytes_per_step"] = {impl: ranks[0][impl]["bytes"] for impl in IMPLS}
    tp_bytes = {impl: sum(ranks[0][impl]["bytes"].values()) for impl in ("raytp", "raytp_bf16")}
    fig["bytes_ratio_bf16_over_fp32"] = round(tp_bytes["raytp_bf16"] / tp_bytes["raytp"], 3)
    fig["timed_steps_each"] = len(per_step["raytp"])
    return fig


def run(quick: bool = False) -> dict:
    import shutil

    import numpy as np

    from raytp.data.corpus import Corpus
    s = QUICK if quick else FULL
    tokens = np.random.default_rng(0).integers(0, s["vocab"], 1 << 18)  # the ids of a BPE vocabulary
    corpus = Corpus(tokens, tokens[:4096], s["vocab"], "synthetic")
    n = s["warmup"] + 1 + s["timed"]
    data = [batch(corpus, "train", HYPER.seed, i, 0, 1, s["batch"], s["T"]) for i in range(n)]
    d = _hf_dir(s)
    out: dict = {"peer": PEER, "goal": "ratio_raytp_over_transformers <= 0.8",
                 "model": (f"Llama {s['layers']}L x {s['width']} wide, {s['heads']} heads / {s['kv']} KV heads, "
                           f"SwiGLU {s['ffn']}, vocab {s['vocab']}, T={s['T']}, batch {s['batch']}, AdamW + clip"),
                 "cpu_cores": os.cpu_count(), "torch": torch.__version__}
    try:
        for tp in s["tps"]:
            out[f"tp{tp}"] = measure(tp, s, d, data)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out["goal_met"] = all(out[f"tp{tp}"]["ratio_raytp_over_transformers"] <= 0.8 for tp in s["tps"])
    return out
