"""The TP and EP plan of an MoE layer (raytp.models.moe.layer), applied by a model's plan
(raytp.models.llama.plan).

Experts over ranks (expert parallelism, ``ExpertPlace``): a rank keeps the experts of its place in its EP
group only, ``n_experts / ep`` consecutive ones, under their global names, and its ``dispatch`` exchanges
tokens over that group (raytp.parallel.expert_dispatch).

Inside an expert (``etp``): with etp == tp every expert, and the shared experts, split as a dense SwiGLU MLP
does (Megatron's expert tensor parallelism): gate and up by output columns, down by input rows; every TP rank
runs every token through its slices and leaves a partial sum. With etp == 1 each rank holds its experts
whole, and each TP rank runs its own share of the tokens (``token_share``), the other rows zero; the shared
experts stay split over TP. Either way one ParallelInput (f, or the sequence all-gather under SP) feeds the
router and the experts, and one ParallelOutput (g, or the reduce-scatter) sums the TP ranks' parts: two
all-reduces forward and two backward per layer, as for a dense MLP.

The router (and the shared experts' gate) is replicated and runs on every TP rank on the same tokens, but the
gradient each rank sends back into it is partial (through its slices of the experts, or its share of the
tokens), so their weights are tagged ``partial_over_tp``: raytp.train.step sums their gradients over TP.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from raytp.models.moe.grouped import LEAVES
from raytp.models.moe.layer import MoE
from raytp.parallel.expert_dispatch import ExpertDispatch
from raytp.parallel.layers import ParallelInput, ParallelOutput, ShardedLinear
from raytp.parallel.placements import Shard

# (regex over parameter names, split over TP when etp == tp), for a model's table; the router and shared
# gate are replicated.
SHARDING: tuple[tuple[str, Shard], ...] = (
    (r"layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\.(gate|up)_proj\.weight", Shard(0)),
    (r"layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\.down_proj\.weight", Shard(1)),
)
EXPERT_WEIGHT = re.compile(r"layers\.\d+\.mlp\.experts\.\d+\.")  # a routed expert's (not the shared ones')


@dataclass(frozen=True)
class ExpertPlace:
    """Where a rank's experts are: its EP group (None: one rank), the EP degree and its place there, and whether
    each expert is split over the TP group (etp == tp) or whole on every rank (etp == 1)."""
    group: object = None
    ep: int = 1
    ep_rank: int = 0
    split_over_tp: bool = True

    @classmethod
    def of(cls, groups) -> "ExpertPlace":
        """The place of a rank with these ProcessGroups (raytp.parallel.groups)."""
        lay = groups.layout
        if not lay.experts_split:
            return cls()
        return cls(groups.group("ep"), lay.ep, lay.coord(groups.rank, "ep"), lay.expert_tp == lay.tp)

    def holds(self, expert: int, n_experts: int) -> bool:
        per = n_experts // self.ep
        return self.ep_rank * per <= expert < (self.ep_rank + 1) * per


def parallelize(moe: MoE, prefix: str, group, sequence_parallel: bool, sliced, place: ExpertPlace) -> None:
    """Keep this rank's experts and swap in the collectives (`prefix`: the layer's name, e.g. ``layers.3.mlp``;
    `sliced(name, weight, whole=False)`: this rank's slice of a parameter, or all of it; `group`: the TP
    group, None at tp == 1)."""
    n = moe.args.n_experts
    for j in [j for j in moe.experts if not place.holds(int(j), n)]:
        del moe.experts[j]
    moe.dispatch = ExpertDispatch(n, place.group, place.ep, place.ep_rank)
    if group is None:  # tp == 1: the experts are made whole from the source, with the rest
        return
    moe.tp_in = ParallelInput(group, sequence_parallel)
    moe.tp_out = ParallelOutput(group, sequence_parallel)
    moe.token_share = not place.split_over_tp
    experts = [(f"experts.{j}", e, not place.split_over_tp) for j, e in moe.experts.items()]
    if moe.shared_expert is not None:
        experts.append(("shared_expert", moe.shared_expert, False))
    for name, expert, whole in experts:
        for leaf in LEAVES:
            weight = sliced(f"{prefix}.{name}.{leaf}.weight", getattr(expert, leaf).weight, whole)
            setattr(expert, leaf, ShardedLinear(weight))
            if whole:  # files and states read it whole though TP splits its kind (raytp.files.checkpoint)
                getattr(expert, leaf).weight.whole_on_rank = True


def tag(moe: MoE) -> None:
    """Mark the replicated weights whose gradients are partial on each TP rank."""
    moe.gate.weight.partial_over_tp = True
    if moe.shared_expert_gate is not None:
        moe.shared_expert_gate.weight.partial_over_tp = True
