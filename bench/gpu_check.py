"""gpu_check: raytp's step on one GPU, without Ray: throughput, MFU and memory against the estimate, the MoE
experts grouped against looped, and the TP entries' overlap on CUDA tensors.

Run where a GPU is (``python -m bench.gpu_check [--quick] [--out FILE]``; ``--quick`` on CPU checks the
script itself). Each part is reported apart; one that fails reports its error and the others still run.

- ``dense``: a TinyLlama-1.1B-shaped Llama (22 layers, 2048 wide, 32 heads / 4 KV heads, SwiGLU 5632, vocab
  32000, T=2048), bf16 autocast over float32 masters, fused AdamW, micro-batch 4: tokens/s, TFLOP/s and MFU
  (raytp.train.efficiency), and the CUDA allocator's peak against raytp.runtime.estimate's per-device figure.
- ``moe``: an 8-layer MoE Llama of the same width (8 experts of width 5632, top 2, aux loss): the same
  figures with the experts grouped (``torch._grouped_mm``, raytp.models.moe.grouped), then looped, and the
  losses of the two paths' first steps.
- ``moe_layer``: raytp's MoE layer against torchtitan 0.3.0's (bench.moe's pairing: the same weights; its
  ``GroupedExperts``), D=2048, F=5632, 8 experts, top 2, 8192 tokens, forward and backward under bf16,
  taking turns (torchtitan carried where the machine has no index: see bench/moe).
- ``tp_overlap``: two gloo ranks on the one GPU (gloo on CUDA tensors; NCCL refuses two ranks on one device),
  a Llama at TP=2 in bf16: 3 steps with ``parallel.tp_overlap`` on and off, equal to the bit, and the time
  its entries' collectives ran behind compute.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch

DENSE = {"arch": "llama", "n_layer": 22, "n_head": 32, "n_kv_head": 4, "n_embd": 2048, "intermediate_size": 5632,
         "block_size": 2048, "vocab_size": 32000}
MOE = {**DENSE, "n_layer": 8, "n_kv_head": 8,
       "moe": {"n_experts": 8, "top_k": 2, "moe_ffn": 5632, "aux_coeff": 0.01}}
QUICK = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "intermediate_size": 128, "block_size": 64,
         "vocab_size": 256}


def _job(model: dict, batch: int, device: str):
    from raytp.config import from_dict
    return from_dict({"model": model, "parallel": {"tp": 1, "dp": 1},
                      "train": {"batch_size": batch, "precision": "bf16", "steps": 100},
                      "recovery": {"snapshot_every": 0}, "runtime": {"device": device}})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _train(cfg, device: torch.device, warmup: int, timed: int, loop_experts: bool = False) -> dict:
    """Build the one-device shard of job `cfg` and time `timed` steps after `warmup`."""
    from raytp.config.adapters import hyper, model_args
    from raytp.models.moe import grouped
    from raytp.models.shard import build_shard
    from raytp.parallel.groups import ProcessGroups
    from raytp.parallel.layout import Layout
    from raytp.train.step import make_optimizer, train_step
    args, h = model_args(cfg), hyper(cfg)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build_shard(args, cfg.train.seed, None, device=device)
    opt = make_optimizer(model, h)
    groups = ProcessGroups(Layout(1, dp=1), 0)
    gen = torch.Generator().manual_seed(0)
    T, b = args.block_size, cfg.micro_batch
    real = grouped.use_grouped
    if loop_experts:
        grouped.use_grouped = lambda *a: False
    try:
        times, losses = [], []
        for step in range(warmup + timed):
            x = torch.randint(0, args.vocab_size, (b, T), generator=gen).to(device)
            _sync(device)
            t0 = time.perf_counter()
            losses.append(train_step(model, opt, [(x, x.roll(-1, 1))], groups, step, h).loss)
            _sync(device)
            if step >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        grouped.use_grouped = real
    step_s = statistics.median(times)
    out = {"step_s": round(step_s, 4), "tokens_per_s": round(b * T / step_s), "first_losses": losses[:3]}
    if device.type == "cuda":
        out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    del model, opt
    return out


def _figures(cfg, fig: dict, device: torch.device) -> dict:
    from raytp.config.adapters import model_args
    from raytp.runtime.estimate import estimate
    from raytp.train.efficiency import peak_tflops, step_figures
    name = torch.cuda.get_device_name() if device.type == "cuda" else None
    fig.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in
                step_figures(model_args(cfg), fig["tokens_per_s"], 1, peak_tflops(name)).items()})
    est = estimate(cfg)
    fig["estimate_on_device_bytes"] = est.on_device
    fig["estimate_parts"] = est.parts()
    if "peak_allocated_bytes" in fig:  # the tensors against the estimate's; what the GPU held against all of it
        fig["peak_allocated_over_estimate"] = round(fig["peak_allocated_bytes"] / est.tensors, 3)
        fig["peak_reserved_over_estimate"] = round(fig["peak_reserved_bytes"] / est.on_device, 3)
    return fig


def dense(device: torch.device, quick: bool) -> dict:
    cfg = _job({**DENSE, **(QUICK if quick else {})}, 2 if quick else 4, device.type)
    return _figures(cfg, _train(cfg, device, 1 if quick else 3, 2 if quick else 10), device)


def moe(device: torch.device, quick: bool) -> dict:
    from raytp.models.moe.grouped import expert_kernel
    model = {**MOE, **(QUICK if quick else {})}
    if quick:
        model["moe"] = {**MOE["moe"], "moe_ffn": 64}
    cfg = _job(model, 2 if quick else 4, device.type)
    warm, timed = (1, 2) if quick else (3, 8)
    grouped = _figures(cfg, _train(cfg, device, warm, timed), device)
    looped = _train(cfg, device, warm, timed, loop_experts=True)
    return {"kernel": expert_kernel(device.type, torch.bfloat16), "grouped": grouped, "looped": looped,
            "grouped_over_looped_step": round(grouped["step_s"] / looped["step_s"], 3),
            "first_loss_diff": abs(grouped["first_losses"][0] - looped["first_losses"][0])}


def moe_layer(device: torch.device, quick: bool) -> dict:
    """raytp's MoE layer against torchtitan's (bench.moe: the same router and expert weights, torchtitan's
    grouped experts), forward and backward under bf16 on this device, taking turns: medians and ratios; raytp
    with its experts' weights stacked each forward, and packed back to back as a built shard holds them."""
    import copy

    from bench.moe import QUICK as SMALL, _ours, _theirs
    from raytp.models.moe.grouped import pack
    s = dict(SMALL) if quick else {"D": 2048, "F": 5632, "E": 8, "K": 2, "tokens": 8192}
    ours = _ours(s)
    theirs = _theirs(ours, s)
    if theirs is None:
        return {"torchtitan": "not installed"}
    packed = copy.deepcopy(ours).to(device)
    pack(list(packed.experts.values()))
    layers = {"raytp": ours.to(device), "raytp_packed": packed, "torchtitan": theirs.to(device)}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, s["tokens"], s["D"], generator=gen).to(device)
    g = torch.randn(1, s["tokens"], s["D"], generator=gen).to(device)

    def step(layer) -> torch.Tensor:
        xx = x.detach().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = layer(xx)
        (y.float() * g).sum().backward()
        return y.detach().float()
    outs = {name: step(m) for name, m in layers.items()}
    times: dict = {name: [] for name in layers}
    orders = [list(layers), list(reversed(list(layers)))]
    for i in range(4 if quick else 40):
        for name in orders[i % 2]:
            _sync(device)
            t0 = time.perf_counter()
            step(layers[name])
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    fig = {f"{k}_ms": round(1e3 * statistics.median(v[2:] or v), 3) for k, v in times.items()}
    fig["raytp_over_torchtitan"] = round(fig["raytp_ms"] / fig["torchtitan_ms"], 3)
    fig["packed_over_torchtitan"] = round(fig["raytp_packed_ms"] / fig["torchtitan_ms"], 3)
    scale = outs["raytp"].abs().max()
    fig["out_diff"] = float((outs["raytp"] - outs["torchtitan"]).abs().max() / scale)
    fig["packed_out_diff"] = float((outs["raytp_packed"] - outs["raytp"]).abs().max() / scale)
    fig["size"] = s
    return fig


def _overlap_rank(rank: int, world: int, init: str, quick: bool) -> dict:
    import torch.distributed as dist

    from raytp.models.args import ModelArgs
    from raytp.models.shard import build_shard, gather_full_state
    from raytp.parallel import comm
    from raytp.parallel.groups import build_groups
    from raytp.parallel.layers import set_tp_overlap
    from raytp.parallel.layout import Layout
    from raytp.train.hyper import Hyper
    from raytp.train.step import make_optimizer, train_step
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    groups = build_groups(Layout(world), rank)
    size = QUICK if quick else {"n_layer": 4, "n_head": 16, "n_kv_head": 4, "n_embd": 1024,
                                "intermediate_size": 2816, "block_size": 512, "vocab_size": 32000}
    cfg = ModelArgs(arch="llama", **size)
    h = Hyper(lr=1e-3, steps=10, precision="bf16")
    out = {}
    for sp in (False, True):
        runs = []
        for on in (False, True):
            model = build_shard(cfg, 1, groups.tp, sp, device=device)
            set_tp_overlap(model, on)
            opt = make_optimizer(model, h)
            gen = torch.Generator().manual_seed(0)
            losses, hidden, t0 = [], 0.0, time.perf_counter()
            comm.STATS.take_hidden()
            for step in range(3):
                x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=gen).to(device)
                losses.append(train_step(model, opt, [(x, x.roll(-1, 1))], groups, step, h).loss)
            hidden = comm.STATS.take_hidden()
            runs.append((losses, gather_full_state(model, groups.tp), hidden, time.perf_counter() - t0))
        (l0, s0, _, t_off), (l1, s1, hid, t_on) = runs
        out[f"sp={sp}"] = {"losses_equal": l0 == l1, "weights_equal": all(torch.equal(s0[k], s1[k]) for k in s0),
                           "hidden_s": round(hid, 4), "off_s": round(t_off, 3), "on_s": round(t_on, 3)}
    return out


def tp_overlap(quick: bool) -> dict:
    from bench.common import spawn
    from bench.gpu_check import _overlap_rank as rank  # by its module's name (this file may run as __main__)
    return spawn(2, rank, quick)[0]


def run(quick: bool = False, parts=("dense", "moe", "moe_layer", "tp_overlap")) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "quick": quick}
    for name, part in (("dense", lambda: dense(device, quick)), ("moe", lambda: moe(device, quick)),
                       ("moe_layer", lambda: moe_layer(device, quick)), ("tp_overlap", lambda: tp_overlap(quick))):
        if name not in parts:
            continue
        t0 = time.perf_counter()
        try:
            out[name] = part()
        except Exception as e:  # noqa: BLE001 (each part reports its own failure; the others still run)
            out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        out[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({name: out[name]}, default=str), flush=True)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--parts", default="dense,moe,moe_layer,tp_overlap", help="which parts, comma-separated")
    a = ap.parse_args()
    result = run(a.quick, tuple(a.parts.split(",")))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2, default=str)
