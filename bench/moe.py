"""moe: an MoE layer's forward and backward, raytp's against torchtitan's (the same weights), at EP=1 and EP=2.

- EP=1, one process: raytp's MoE layer (raytp.models.moe.layer: float32 router, its experts one at a time on
  CPU, raytp.models.moe.grouped; in fp32 and under bf16 autocast) against torchtitan
  0.3.0's ``MoE`` (softmax router with route_norm, ``GroupedExperts`` in bf16 through ``torch._grouped_mm``,
  its local token dispatcher), given the same router and expert weights. They take turns; medians of
  forward + backward of ``(y * g).sum()``, their ratio, and how far the outputs are apart.
- EP=2, two gloo ranks: raytp's layer with its experts split over the two (each rank its own tokens) against
  torchtitan's with its ``AllToAllTokenDispatcher`` wired to a CPU DeviceMesh of the two ranks (plain
  functional collectives) and each rank's half of the same experts; step times (the slower rank's), the
  outputs apart, raytp against EP=1 on the same tokens, and the rows its all-to-all moves each way per
  forward against the formula (tokens x k rows of n_embd each way: dispatch and combine), of which those
  that cross ranks.
- memory: what an MoE Llama's rank holds, measured, against the job's memory estimate (bench.moe_memory).

torchtitan is imported from the ``torchtitan`` package when installed (``pip install --no-deps
torchtitan==0.3.0 spmd_types==0.2.3 einops tyro docstring_parser triton``: its other requirements are its
trainer's); without it the peer is reported missing and raytp's figures stand alone.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from bench import moe_memory
from bench.common import spawn, timed
from raytp.models.moe.args import MoeArgs
from raytp.models.moe.layer import MoE
from raytp.models.moe.plan import ExpertPlace, parallelize
from raytp.parallel.groups import build_groups
from raytp.parallel.layout import Layout

PEER = "torchtitan 0.3.0's MoE layer (softmax router, GroupedExperts via torch._grouped_mm in bf16), same weights"
FULL = {"D": 256, "F": 512, "E": 8, "K": 2, "tokens": 2048, "warmup": 3, "timed": 20}
QUICK = {"D": 64, "F": 64, "E": 4, "K": 2, "tokens": 128, "warmup": 1, "timed": 3}


def _ours(s: dict, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(s["D"], MoeArgs(n_experts=s["E"], top_k=s["K"], moe_ffn=s["F"]))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return m.train()


def _theirs(ours: MoE, s: dict, ep_mesh=None, first: int = 0, local: int | None = None):
    """torchtitan's MoE with `ours`'s weights (None where torchtitan is not installed); with `ep_mesh` (a
    DeviceMesh of the EP ranks) its all-to-all dispatcher and this rank's `local` experts from `first`."""
    try:
        from torchtitan.distributed import utils as tt_dist
        from torchtitan.models.common import moe as tt
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
    except ImportError:
        return None
    E, D, F = s["E"], s["D"], s["F"]
    local = E if local is None else local
    dispatcher = (AllToAllTokenDispatcher if ep_mesh is not None else LocalTokenDispatcher).Config(
        num_experts=E, top_k=s["K"])
    m = tt.MoE.Config(num_experts=E, load_balance_coeff=None, routed_experts=tt.RoutedExperts.Config(
        inner_experts=tt.GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=local),
        token_dispatcher=dispatcher),
        router=tt.TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=D, out_features=E),
                                               top_k=s["K"], score_func="softmax", route_norm=True)).build()
    if ep_mesh is not None:  # plain functional collectives over the mesh (not its spmd_types typing)
        tt_dist._spmd_backend = "dtensor"
        m.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
    experts = [ours.experts[str(j)] for j in range(first, first + local)]
    with torch.no_grad():
        m.router.gate.weight.copy_(ours.gate.weight)
        inner = m.routed_experts.inner_experts
        inner.w1_EFD.copy_(torch.stack([e.gate_proj.weight for e in experts]))
        inner.w3_EFD.copy_(torch.stack([e.up_proj.weight for e in experts]))
        inner.w2_EDF.copy_(torch.stack([e.down_proj.weight for e in experts]))
    return m.train()


def _step(layer, x: torch.Tensor, g: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = layer(x)
    (y.float() * g).sum().backward()
    return y.detach().float()


def _ep1(s: dict) -> dict:
    ours = _ours(s)
    theirs = _theirs(ours, s)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, s["tokens"], s["D"], generator=gen)
    g = torch.randn(1, s["tokens"], s["D"], generator=gen)
    impls = {"raytp": lambda: _step(ours, x, g), "raytp_bf16": lambda: _step(ours, x, g, bf16=True)}
    if theirs is not None:
        impls["torchtitan"] = lambda: _step(theirs, x, g)
    out = {name: fn() for name, fn in impls.items()}  # warm-up, and the outputs compared
    for _ in range(s["warmup"] - 1):
        for fn in impls.values():
            fn()
    times = {name: [] for name in impls}
    for i in range(s["timed"]):
        names = list(impls) if i % 2 == 0 else list(reversed(impls))
        for name in names:
            t0 = time.perf_counter()
            impls[name]()
            times[name].append(time.perf_counter() - t0)
    fig = {f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()}
    if theirs is not None:
        scale = float(out["raytp"].abs().max())
        fig["vs_torchtitan"] = fig["raytp_ms"] / fig["torchtitan_ms"]
        fig["bf16_vs_torchtitan"] = fig["raytp_bf16_ms"] / fig["torchtitan_ms"]
        fig["out_diff_vs_torchtitan"] = float((out["raytp"] - out["torchtitan"]).abs().max()) / scale
        fig["out_diff_bf16_vs_torchtitan"] = float((out["raytp_bf16"] - out["torchtitan"]).abs().max()) / scale
    else:
        fig["torchtitan"] = "not installed"
    return fig


def _ep_rank(rank: int, world: int, init: str, s: dict) -> dict:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = build_groups(Layout(1, dp=world, ep=world), rank)
    layer = _ours(s)  # every rank the same weights; the plan keeps this rank's experts
    local = s["E"] // world
    theirs, theirs_error = None, "not installed"
    try:
        from torch.distributed.device_mesh import init_device_mesh
        theirs = _theirs(layer, s, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)), rank * local, local)
    except (ImportError, RuntimeError) as e:
        theirs_error = f"{type(e).__name__}: {e}"
    parallelize(layer, "mlp", None, False, None, ExpertPlace.of(groups))
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens
    x = torch.randn(1, s["tokens"] // world, s["D"], generator=gen)
    g = torch.randn(1, s["tokens"] // world, s["D"], generator=gen)
    impls = {"raytp": lambda: _step(layer, x, g), "raytp_bf16": lambda: _step(layer, x, g, bf16=True)}
    if theirs is not None:
        impls["torchtitan"] = lambda: _step(theirs, x, g)
    out = {name: fn() for name, fn in impls.items()}
    for _ in range(s["warmup"] - 1):
        for fn in impls.values():
            fn()
    times = {name: [] for name in impls}
    for i in range(s["timed"]):  # the same order on both ranks (they meet in the all-to-alls)
        for name in (list(impls) if i % 2 == 0 else list(reversed(impls))):
            times[name].append(timed(impls[name])[0])
    fig = {f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()}
    fig["crossing_rows"] = layer.dispatch.sent_rows
    if theirs is not None:
        scale = float(out["raytp"].abs().max())
        fig["out_diff_bf16_vs_torchtitan"] = float((out["raytp_bf16"] - out["torchtitan"]).abs().max()) / scale
    else:
        fig["torchtitan"] = theirs_error
    return fig


def run(quick: bool = False) -> dict:
    s = QUICK if quick else FULL
    fig = {"peer": PEER, "size": {k: v for k, v in s.items() if k not in ("warmup", "timed")}, "ep1": _ep1(s)}
    ranks = spawn(2, _ep_rank, s)
    rows = s["tokens"] * s["K"]  # every choice is one row each way, wherever its expert is
    slowest = {k: max(r[k] for r in ranks) for k in ranks[0] if k.endswith("_ms")}
    fig["ep2"] = {**slowest, "vs_ep1": slowest["raytp_ms"] / fig["ep1"]["raytp_ms"],
                  "rows_each_way": rows, "bytes_each_way_fp32": rows * s["D"] * 4,
                  "crossing_rows": sum(r["crossing_rows"] for r in ranks)}
    if "torchtitan_ms" in slowest:
        fig["ep2"]["bf16_vs_torchtitan"] = slowest["raytp_bf16_ms"] / slowest["torchtitan_ms"]
        fig["ep2"]["out_diff_bf16_vs_torchtitan"] = max(r["out_diff_bf16_vs_torchtitan"] for r in ranks)
    else:
        fig["ep2"]["torchtitan"] = ranks[0].get("torchtitan")
    fig["memory"] = moe_memory.run(quick)
    return fig
