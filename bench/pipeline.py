"""pipeline: raytp's pipeline parallelism against torch.distributed.pipelining, its bubble and its memory.

Step time (issue 19, "Performance and memory"): the same GPT, the same stage split
(raytp.models.stage's default), the same seeded weights and batches, trained at each layout
(tp x pp) by raytp (``PipelineSchedule("1f1b")`` in ``train_step``), by torch's ``PipelineStage`` +
``Schedule1F1B`` on raytp's stage shard (bench/pipeline_peer.py), and by raytp's interleaved 1F1B with
2 model chunks per stage (``raytp_interleaved``: a smaller bubble, (p-1)/(2m+p-1); torch's interleaved
schedule is not run), in one spawned process group per layout (gloo, one thread per rank). They take
turns step by step, the order rotating, after untimed warm-up steps; a step's time is the slowest
rank's, every rank starting it at a barrier. Figures: median step times, their ratios to torch's, the
median of paired ratios (neighbouring steps: less sensitive to other programs' load on the shared
cores), the CPU seconds a step costs (all ranks' processes: the work done, whatever else ran), and
every step's loss (the same maths: equal to float rounding).

Bubble: at pp = 2, raytp's step with m = 8, 16, 32 micro-batches of the same size; each rank's busy time
is the wall time spent inside the stage's forwards (hooks on the model) and backwards
(``Tensor.backward``) during the schedule, and its idle share is 1 - busy / (the schedule's span from the
first rank's start to the last rank's end: one clock, CLOCK_MONOTONIC, across the processes), against
1F1B's (p-1)/(m+p-1), which assumes equal stages, and against the idle the 1F1B table makes of the
stages' measured forward and backward times (``one_f_one_b_idle``): what is left beyond that
(``idle_beyond_model``) is the runtime's own cost (point-to-point, Python, the first micro-batch's
slower start). ``cpu_share_while_busy`` below 1 says other programs took the cores meanwhile (the
figures are then worth less).

Memory: in one more step of each m, the bytes of the activations autograd saves for backward that are
alive at once (``saved_tensors_hooks``: each distinct storage counted once, parameters left out), peak
over the step, against the bytes one micro-batch's forward saves (measured after the stage's first
forward): 1F1B keeps p - s micro-batches on stage s. And each stage's training state (weights,
gradients, AdamW moments, measured after steps) against its parameters x 16 bytes.

pp = 1 is not measured here: at pp = 1 raytp does not use PipelineSchedule (raytp.train.schedule.accumulate
runs, as before pipelines), so there is no pipeline overhead to add.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.common import HYPER, SEED, corpus, spawn, timed
from bench.pipeline_peer import PEER, TorchPipeline
from bench.pipeline_probes import BusyPipeline, SavedActivations, one_f_one_b_idle
from raytp.models.args import ModelArgs
from raytp.models.registry import model_class
from raytp.models.shard import build_shard
from raytp.models.stage import keep_stage, stage_of
from raytp.parallel.groups import build_groups
from raytp.parallel.layout import Layout
from raytp.parallel.pipeline.pp_schedule import bubble
from raytp.data.corpus import batch
from raytp.train.optimizer import DistributedAdamW
from raytp.train.stage_runner import PipelineSchedule
from raytp.train.step import make_optimizer, train_step

INTERLEAVED, V = "raytp_interleaved", 2  # raytp's interleaved 1F1B, 2 model chunks per stage
IMPLS = ("raytp", "torch", INTERLEAVED)  # trained side by side; raytp's 1F1B is the like-for-like one


@dataclass(frozen=True)
class Size:
    cfg: ModelArgs
    mb_size: int                        # sequences per micro-batch
    m: int                              # micro-batches per step in the comparison
    warmup: int                         # untimed steps per implementation (losses compared)
    timed: int                          # timed steps per implementation
    layouts: tuple[tuple[int, int], ...]  # (tp, pp)
    bubble_ms: tuple[int, ...]          # micro-batches per step for the bubble and memory figures (pp = 2)
    bubble_steps: int                   # measured steps per m


FULL = Size(ModelArgs(n_layer=8, n_head=4, n_embd=256, block_size=128, vocab_size=1024, dropout=0.0),
            mb_size=2, m=8, warmup=2, timed=15, layouts=((1, 2), (1, 4), (2, 2)), bubble_ms=(8, 16, 32),
            bubble_steps=5)
QUICK = Size(ModelArgs(n_layer=8, n_head=2, n_embd=32, block_size=16, vocab_size=256, dropout=0.0),
             mb_size=1, m=4, warmup=1, timed=2, layouts=((1, 2), (1, 4), (2, 2)), bubble_ms=(4, 8),
             bubble_steps=1)


def size(quick: bool) -> Size:
    return QUICK if quick else FULL


def step_batch(data, s: Size, m: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch of m micro-batches (every stage holds it whole: no DP)."""
    return batch(data, "train", SEED, step, 0, 1, m * s.mb_size, s.cfg.block_size)


def micro(x: torch.Tensor, y: torch.Tensor, m: int) -> list:
    return list(zip(x.chunk(m), y.chunk(m)))


def state_bytes(model: torch.nn.Module, opt: DistributedAdamW) -> int:
    """Bytes of a stage's training state: weights, gradients and the optimizer's tensors."""
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    return total + opt.state_nbytes()


# ---------------------------------------------------------------- ranks

def _setup(rank: int, world: int, init: str, s: Size, tp: int, pp: int):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = build_groups(Layout(tp, pp=pp), rank)
    return groups, stage_of(s.cfg, pp, groups.pp_rank)


def _compare(rank: int, world: int, init: str, quick: bool, tp: int, pp: int) -> dict:
    """raytp (1F1B and interleaved) and torch's pipelining taking turns on one layout; this rank's times,
    CPU times and losses, and raytp's state bytes and bytes sent."""
    s = size(quick)
    groups, stage = _setup(rank, world, init, s, tp, pp)
    stages = {"raytp": stage, "torch": stage, INTERLEAVED: stage_of(s.cfg, pp, groups.pp_rank, V)}
    models = {impl: build_shard(s.cfg, SEED, groups.tp, stage=stages[impl]) for impl in IMPLS}
    opts = {impl: make_optimizer(models[impl], HYPER) for impl in IMPLS}
    pipes = {"raytp": PipelineSchedule("1f1b", stage, False),
             INTERLEAVED: PipelineSchedule("interleaved", stages[INTERLEAVED], False)}
    peer = TorchPipeline(models["torch"], stage, groups, s.m)
    text = corpus(quick)
    data = [step_batch(text, s, s.m, i) for i in range(s.warmup + s.timed)]

    def step(impl: str, i: int) -> float:
        x, y = data[i]
        if impl == "torch":
            return peer.step(opts[impl], x, y, i, HYPER).loss
        return train_step(models[impl], opts[impl], micro(x, y, s.m), groups, i, HYPER, schedule=pipes[impl]).loss

    out = {impl: {"times": [], "cpu": [], "losses": []} for impl in IMPLS}
    for i in range(s.warmup + s.timed):
        for impl in IMPLS[i % 3:] + IMPLS[:i % 3]:  # each first, second and third equally often
            cpu = time.process_time()
            seconds, loss = timed(lambda: step(impl, i))
            out[impl]["losses"].append(loss)
            if i >= s.warmup:
                out[impl]["times"].append(seconds)
                out[impl]["cpu"].append(time.process_time() - cpu)
    out["state_bytes"] = state_bytes(models["raytp"], opts["raytp"])
    out["params"] = sum(p.numel() for p in models["raytp"].parameters())
    out["layers"] = list(stage.layers)
    out["sent_bytes"] = pipes["raytp"].sent_bytes
    return out


def _bubble(rank: int, world: int, init: str, quick: bool) -> dict:
    """raytp at pp = 2 with each m of bubble_ms: busy time and span of each measured step, saved bytes."""
    s = size(quick)
    groups, stage = _setup(rank, world, init, s, 1, 2)
    text, out = corpus(quick), {}
    for m in s.bubble_ms:
        model = build_shard(s.cfg, SEED, groups.tp, stage=stage)
        opt = make_optimizer(model, HYPER)
        pipe = BusyPipeline("1f1b", stage, False)
        busy, fwd, bwd, busy_cpu, spans = [], [], [], [], []
        for i in range(1 + s.bubble_steps):  # the first: warm-up
            dist.barrier()
            train_step(model, opt, micro(*step_batch(text, s, m, i), m), groups, i, HYPER, schedule=pipe)
            if i:
                busy.append(pipe.busy)
                fwd.append(pipe.forward)
                bwd.append(pipe.busy - pipe.forward)
                busy_cpu.append(pipe.busy_cpu)
                spans.append(pipe.span)
        with SavedActivations(model) as saved:
            dist.barrier()
            last = s.bubble_steps + 1
            train_step(model, opt, micro(*step_batch(text, s, m, last), m), groups, last, HYPER, schedule=pipe)
        assert saved.now == 0, f"{saved.now} saved bytes still alive after the step: the counter is wrong"
        out[m] = {"busy": busy, "fwd": fwd, "bwd": bwd, "busy_cpu": busy_cpu, "spans": spans, "peak": saved.peak,
                  "one_mb": saved.first_forward}
    return out


# ---------------------------------------------------------------- figures

def compare(tp: int, pp: int, quick: bool) -> dict:
    s = size(quick)
    ranks = spawn(tp * pp, _compare, quick, tp, pp)
    per_step = {impl: [max(t) for t in zip(*(r[impl]["times"] for r in ranks))] for impl in IMPLS}
    # CPU seconds of a step, all ranks' processes together: the work done, whatever else ran on the cores
    cpu = {impl: statistics.median(map(sum, zip(*(r[impl]["cpu"] for r in ranks)))) for impl in IMPLS}
    fig: dict = {}
    for impl in IMPLS:
        fig[f"{impl}_median_step_s"] = round(statistics.median(per_step[impl]), 4)
    for impl in ("raytp", INTERLEAVED):
        fig[f"ratio_{impl}_over_torch"] = round(fig[f"{impl}_median_step_s"] / fig["torch_median_step_s"], 3)
        fig[f"paired_ratio_{impl}_over_torch"] = round(statistics.median(
            a / b for a, b in zip(per_step[impl], per_step["torch"])), 3)
        fig[f"cpu_ratio_{impl}_over_torch"] = round(cpu[impl] / cpu["torch"], 3)
    fig["cpu_s_per_step"] = {impl: round(v, 4) for impl, v in cpu.items()}
    fig["losses"] = {impl: [round(v, 5) for v in ranks[0][impl]["losses"]] for impl in IMPLS}
    ref = ranks[0]["torch"]["losses"]
    fig["loss_max_rel_diff_vs_torch"] = {
        impl: float(f"{max(abs(u - v) / abs(v) for u, v in zip(ranks[0][impl]['losses'], ref)):.2e}")
        for impl in ("raytp", INTERLEAVED)}
    fig["timed_steps_each"] = len(per_step["raytp"])
    stage0 = [r for i, r in enumerate(ranks) if i % tp == 0]  # TP rank 0 of each stage
    fig["stage_layers"] = [r["layers"] for r in stage0]
    # bytes sent between stages per step: raytp's counted; torch's PipelineStage sends the whole
    # activation from every TP rank (m x b x s x h x 4 each way per boundary and TP rank)
    b_s_h = s.mb_size * s.cfg.block_size * s.cfg.n_embd
    fig["p2p_bytes_per_step"] = {"raytp": sum(r["sent_bytes"] for r in ranks),
                                 "torch": 2 * s.m * b_s_h * 4 * (pp - 1) * tp}
    if tp * pp > (os.cpu_count() or 1):
        fig["note"] = f"{tp * pp} single-threaded ranks on {os.cpu_count()} cores: oversubscribed (all alike)"
    fig["state"] = state_figures(s.cfg, pp, [r["state_bytes"] for r in stage0], [r["params"] for r in stage0])
    return fig


def state_figures(cfg: ModelArgs, pp: int, state: list[int], params: list[int]) -> dict:
    """Each stage's state (bytes, its TP rank 0) against that rank's parameters x 16; each stage's share of
    the model's parameters (the whole stage, at tp = 1; the last holds a copy of the tied embedding, so
    the shares add up to more than 1); the largest stage's state over the smallest's."""
    with torch.device("meta"):
        total = model_class(cfg)(cfg).num_params()
        whole = [keep_stage(model_class(cfg)(cfg), stage_of(cfg, pp, s)).num_params() for s in range(pp)]
    return {"bytes": state, "over_params_x16": [round(b / (16 * n), 4) for b, n in zip(state, params)],
            "param_share": [round(n / total, 4) for n in whole],
            "largest_over_smallest": round(max(state) / min(state), 3)}


def bubble_figures(quick: bool) -> dict:
    ranks = spawn(2, _bubble, quick)
    out = {}
    for m in size(quick).bubble_ms:
        spans = [max(r[m]["spans"][i][1] for r in ranks) - min(r[m]["spans"][i][0] for r in ranks)
                 for i in range(len(ranks[0][m]["spans"]))]
        idle = [statistics.median(1 - busy / span for busy, span in zip(r[m]["busy"], spans)) for r in ranks]
        busy = [statistics.median(r[m]["busy"]) for r in ranks]
        per_mb = [(statistics.median(r[m]["fwd"]) / m, statistics.median(r[m]["bwd"]) / m) for r in ranks]
        peaks = [r[m]["peak"] for r in ranks]
        cpu = [sum(r[m]["busy_cpu"]) / sum(r[m]["busy"]) for r in ranks]
        model = one_f_one_b_idle(*zip(*per_mb), m)
        out[f"m{m}"] = {"idle_share_per_rank": [round(v, 4) for v in idle], "formula": round(bubble(2, m), 4),
                        "model_with_measured_stage_times": [round(v, 4) for v in model],
                        "idle_beyond_model": [round(v - w, 4) for v, w in zip(idle, model)],
                        "busy_over_busiest": [round(b / max(busy), 4) for b in busy],
                        "cpu_share_while_busy": [round(v, 3) for v in cpu],
                        "median_schedule_s": round(statistics.median(spans), 4),
                        "saved_activation_peak_bytes": peaks,
                        "one_micro_batch_bytes": [r[m]["one_mb"] for r in ranks],
                        "peak_in_micro_batches": [round(p / r[m]["one_mb"], 3) for p, r in zip(peaks, ranks)],
                        "expected_micro_batches": [2 - s for s in range(2)]}
    p0 = [out[f"m{m}"]["saved_activation_peak_bytes"][0] for m in size(quick).bubble_ms]
    out["stage0_peak_max_over_min"] = round(max(p0) / min(p0), 4)
    return out


def run(quick: bool = False) -> dict:
    s = size(quick)
    c = s.cfg
    out: dict = {"peer": PEER,
                 "goal": "ratio_raytp_over_torch <= 0.9; idle within 3 points of (p-1)/(m+p-1); stage 0 peak "
                         "~ p micro-batches, flat in m; state = params x 16; largest stage <= 1.3x the smallest",
                 "model": (f"GPT-2 {c.n_layer} layers x {c.n_embd} wide, {c.n_head} heads, vocab {c.vocab_size}, "
                           f"T={c.block_size}, micro-batch {s.mb_size} sequences, m={s.m}, AdamW + clip 1.0, "
                           f"tied embedding, fp32"),
                 "cpu_cores": os.cpu_count(), "torch": torch.__version__,
                 "pp1": "not measured: pp = 1 runs raytp.train.schedule.accumulate, not PipelineSchedule"}
    load = os.getloadavg()[0]
    for tp, pp in s.layouts:
        out[f"tp{tp}_pp{pp}"] = compare(tp, pp, quick)
    out["bubble_pp2"] = bubble_figures(quick)
    out["load_average_1min"] = {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)}  # others' load
    return out
