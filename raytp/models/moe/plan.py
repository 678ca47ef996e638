"""The TP plan of an MoE layer (raytp.models.moe.layer), applied by a model's plan (raytp.models.llama.plan).

Every expert, and the shared experts, split as a dense SwiGLU MLP does (Megatron's expert tensor parallelism
with etp = tp): gate and up by output columns, down by input rows. One ParallelInput (f, or the sequence
all-gather under SP) feeds the router and every expert; each rank's experts leave a partial sum, weighted by
the router, and one ParallelOutput (g, or the reduce-scatter) joins them: two all-reduces forward and two
backward per layer, as for a dense MLP.

The router (and the shared experts' gate) is replicated and runs on every TP rank on the same tokens, but the
gradient each rank sends back into it is partial (it comes through that rank's slice of the experts), so
their weights are tagged ``partial_over_tp``: raytp.train.step sums their gradients over TP.
"""
from __future__ import annotations

from raytp.models.moe.layer import MoE
from raytp.parallel.layers import ParallelInput, ParallelOutput, ShardedLinear
from raytp.parallel.sharding import Sharding

# (regex over parameter names, sharding), for a model's table; the router and shared gate are replicated.
SHARDING: tuple[tuple[str, Sharding], ...] = (
    (r"layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\.(gate|up)_proj\.weight", Sharding(dim=0)),
    (r"layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\.down_proj\.weight", Sharding(dim=1)),
)


def parallelize(moe: MoE, prefix: str, group, sequence_parallel: bool, sliced) -> None:
    """Swap in the TP collectives and this rank's slices of the experts (`prefix`: the layer's name, e.g.
    ``layers.3.mlp``; `sliced(name, weight)`: this rank's slice of a parameter)."""
    moe.tp_in = ParallelInput(group, sequence_parallel)
    moe.tp_out = ParallelOutput(group, sequence_parallel)
    experts = [(f"experts.{j}", e) for j, e in enumerate(moe.experts)]
    if moe.shared_expert is not None:
        experts.append(("shared_expert", moe.shared_expert))
    for name, expert in experts:
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            weight = sliced(f"{prefix}.{name}.{leaf}.weight", getattr(expert, leaf).weight)
            setattr(expert, leaf, ShardedLinear(weight))


def tag(moe: MoE) -> None:
    """Mark the replicated weights whose gradients are partial on each TP rank."""
    moe.gate.weight.partial_over_tp = True
    if moe.shared_expert_gate is not None:
        moe.shared_expert_gate.weight.partial_over_tp = True
