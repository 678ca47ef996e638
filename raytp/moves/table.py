"""The placement table: every tensor of the training state, and the region of it each rank holds on a layout.

The state is the model's parameters and their AdamW state (``exp_avg``,
``exp_avg_sq``, the ``step`` count), each under one key as checkpoints name it
(``model/<name>``, ``optim/<name>/<k>``). A ``Param`` gives a parameter's global
shape, how TP splits it (its model's row, a ``Split``: raytp.parallel.placements),
whether it is routed expert ``expert`` of ``n_experts``, whether AdamW trains it;
``stages(pp)`` gives the names each pipeline stage holds, in the model's order (a
tied embedding's copy on the last stage too). From these and a Layout,
``StateTable.held`` answers for every rank which region (raytp.moves.regions) of
which tensor it holds, by the rules the shards are built by:

- a dense weight: its TP rank's ranges (``shard_ranges``, padding left out), the
  whole of every other dim; the same on every replica;
- a routed expert's weight, where the layout gives experts a mesh of their own:
  held by the ranks whose EP place holds that expert, split over ETP as a dense
  row would be over TP (whole at etp 1); elsewhere as a dense weight;
- its AdamW moments: as the weight, or, under the distributed optimizer, the
  local rows the rank's DP x CP place owns in the cut of its stage's bucketed
  parameters (raytp.parallel.zero_plan; experts cut apart, over expert-DP); the
  step count wherever a rank keeps state of that parameter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from raytp.moves.regions import Region
from raytp.parallel.layout import Layout
from raytp.parallel.placements import REPLICATE, Split
from raytp.parallel.sharding import local_shape, shard_ranges
from raytp.parallel.zero_plan import BUCKET_NUMEL, owned_rows, plan

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    split: Split = REPLICATE
    expert: int | None = None   # routed expert `expert` of `n_experts` (an MoE layer's), or None
    n_experts: int = 0
    trained: bool = True        # a router's selection bias is not: no AdamW state
    itemsize: int = 4           # bytes per element of the weight (AdamW's state: 4)


@dataclass(frozen=True)
class Held:
    """One tensor a rank holds: its key, the region, the local tensor's shape (padding included), bytes per
    element."""
    key: str
    region: Region
    shape: tuple[int, ...]
    itemsize: int


@dataclass
class StateTable:
    params: list[Param]
    stages: Callable[[int], list[list[str]]]  # pp -> each stage's parameter names, in the model's order
    bucket_numel: int = BUCKET_NUMEL
    _by_name: dict = field(init=False, repr=False)
    _cuts: dict = field(init=False, repr=False)
    _held: dict = field(init=False, repr=False)

    def __post_init__(self):
        self._by_name, self._cuts, self._held = {p.name: p for p in self.params}, {}, {}

    def stage_params(self, pp: int) -> list[list[Param]]:
        """Each of `pp` stages' parameters, in the model's order (the cut worked out once per pp)."""
        if pp not in self._cuts:
            stages = self.stages(pp)
            if len(stages) != pp:
                raise ValueError(f"the table's stage cut has {len(stages)} stages, the layout {pp}")
            self._cuts[pp] = [[self._by_name[n] for n in names] for names in stages]
        return self._cuts[pp]

    def held(self, layout: Layout, state: bool = True) -> list[dict[str, Held]]:
        """For each rank of `layout`: {key: Held} of every tensor it holds (its weights alone without `state`:
        before the first update, AdamW has none). Ranks that hold the same share one dict (read only). The
        last few layouts' answers are kept: a change plans from the old layout and to the new one again and
        again (every recovery at the same layout)."""
        if (layout, state) in self._held:
            return self._held[layout, state]
        stages = self.stage_params(layout.pp)
        seen: dict[tuple, dict[str, Held]] = {}  # ranks in the same place hold the same: one dict for them all
        out = []
        for r, at in enumerate(places(layout)):
            if at not in seen:
                seen[at] = self._rank(layout, r, stages[at[0]], state)
            out.append(seen[at])
        return self._keep((layout, state), out)

    def _keep(self, key: tuple, value):
        if len(self._held) >= 16:  # the last few layouts' answers
            self._held.pop(next(iter(self._held)))
        self._held[key] = value
        return value

    def holders(self, layout: Layout, state: bool = True) -> dict[str, dict[Region, tuple[int, ...]]]:
        """{key: {each distinct region of it held on `layout`: the ranks holding it, ascending}} (one tuple for each
        distinct set of ranks: a replicated tensor's is the same tuple for all its keys); kept as ``held`` is."""
        if (layout, state, "holders") in self._held:
            return self._held[layout, state, "holders"]
        before = self.held(layout, state)
        alike: dict[int, list[int]] = {}  # ranks holding the same (one dict), ascending
        for i, held in enumerate(before):
            alike.setdefault(id(held), []).append(i)
        groups = list(alike.values())
        by: dict[str, dict[Region, list[int]]] = {}  # key -> each distinct region held -> the groups holding it
        for g, ranks in enumerate(groups):
            for key, h in before[ranks[0]].items():
                by.setdefault(key, {}).setdefault(h.region, []).append(g)
        out: dict[str, dict[Region, tuple[int, ...]]] = {}
        interned: dict[tuple, tuple] = {}
        for key, regions in by.items():
            for region, gs in regions.items():
                sig = tuple(gs)
                if sig not in interned:
                    interned[sig] = tuple(sorted(r for g in gs for r in groups[g]))
                out.setdefault(key, {})[region] = interned[sig]
        return self._keep((layout, state, "holders"), out)

    def held_by(self, layout: Layout, rank: int, state: bool = True) -> dict[str, Held]:
        """{key: Held} of every tensor `rank` of `layout` holds (one rank's row of ``held``)."""
        return self._rank(layout, rank, self.stage_params(layout.pp)[layout.coords(rank).pp], state)

    def _rank(self, layout: Layout, rank: int, params: list[Param], state: bool) -> dict[str, Held]:
        weights = {p.name: self._weight(layout, rank, p) for p in params}
        weights = {n: w for n, w in weights.items() if w is not None}
        out = {f"model/{n}": Held(f"model/{n}", r, s, self._by_name[n].itemsize) for n, (r, s) in weights.items()}
        if not state:
            return out
        trained = [p for p in params if p.trained and p.name in weights]
        split = layout.experts_split
        dense = [p for p in trained if not (split and p.expert is not None)]
        apart = [p for p in trained if split and p.expert is not None]
        for group, degree, place, sharded in (
                (dense, layout.grad_degree, layout.grad_place(rank), layout.sharded_optimizer),
                (apart, layout.degree("edp"), layout.coord(rank, "edp"), layout.sharded_experts)):
            rows = _rows(tuple(weights[p.name][1] for p in group), degree, self.bucket_numel, place) \
                if sharded else None
            for i, p in enumerate(group):
                region, shape = weights[p.name]
                if rows is not None:
                    if i not in rows:
                        continue  # none of its rows here: no AdamW state of it at all
                    a, b = rows[i]
                    region, shape = region.rows(a, b), (b - a,) + shape[1:] if shape else shape
                for k in MOMENTS:
                    out[f"optim/{p.name}/{k}"] = Held(f"optim/{p.name}/{k}", region, shape, 4)
                out[f"optim/{p.name}/step"] = Held(f"optim/{p.name}/step", Region(()), (), 4)
        return out

    @staticmethod
    def _weight(layout: Layout, rank: int, p: Param) -> tuple[Region, tuple[int, ...]] | None:
        """(region, local shape) of `p`'s weight on `rank`; None if it does not hold it."""
        degree, place = layout.tp, layout.coord(rank, "tp")
        if p.expert is not None and layout.experts_split:
            if layout.coord(rank, "ep") != p.expert // (p.n_experts // layout.ep):
                return None
            degree, place = layout.expert_tp, layout.coord(rank, "etp")
        return _slice(p, degree, place)


@lru_cache(maxsize=32)
def places(layout: Layout) -> tuple[tuple, ...]:
    """Every rank's ``place``, rank 0 first."""
    return tuple(place(layout, r) for r in range(layout.world_size))


def place(layout: Layout, rank: int) -> tuple:
    """What a rank's held state depends on: its stage and TP place, its EP and ETP places where experts have a mesh
    of their own, its DP x CP (expert-DP) place where the optimizer's rows (the experts') are cut over it."""
    c = layout.coords(rank)
    split = layout.experts_split
    return (c.pp, c.tp, layout.coord(rank, "ep") if split else None, layout.coord(rank, "etp") if split else None,
            layout.grad_place(rank) if layout.sharded_optimizer else None,
            layout.coord(rank, "edp") if split and layout.sharded_experts else None)


@lru_cache(maxsize=1024)  # a plan asks the same cut for every replica: once
def _rows(shapes: tuple, degree: int, bucket_numel: int, place: int) -> dict[int, tuple[int, int]]:
    """The rows DP place `place` of `degree` owns of each of a shard's bucketed parameters (by position)."""
    return owned_rows(plan(list(shapes), degree, bucket_numel), place)


@lru_cache(maxsize=1 << 16)
def _slice(p: Param, degree: int, place: int) -> tuple[Region, tuple[int, ...]]:
    """(region, local shape) of TP (or ETP) place `place` of `degree`'s slice of `p`."""
    s = p.split
    whole = Region.whole(p.shape)
    if s.dim is None or degree == 1:
        return whole, tuple(p.shape)
    size = p.shape[s.dim]
    ranges = [(r.start, min(r.stop, size)) for r in shard_ranges(s, size, place, degree) if r.start < size]
    return whole.split(s.dim, tuple(ranges)), local_shape(s, tuple(p.shape), degree)


@lru_cache(maxsize=16)
def model_table(cfg, v: int = 1, pp_layers: tuple[int, ...] | None = None,
                bucket_numel: int = BUCKET_NUMEL) -> StateTable:
    """The table of a model config (raytp.models.args.ModelArgs): its parameters as the meta model lists them,
    each split by its model's row, and its stage cut (`v` chunks a stage, `pp_layers`: the job's;
    hashable, as a tuple). Built once per distinct arguments."""
    import torch

    from raytp.models.moe.plan import EXPERT_WEIGHT
    from raytp.models.registry import UNTRAINED, model_class, split_of
    from raytp.models.stage import holds, stage_of

    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    n_experts = cfg.moe.n_experts if cfg.moe is not None else 0
    params = []
    for name, p in model.named_parameters():
        m = EXPERT_WEIGHT.match(name)
        expert = int(m.group(0).rstrip(".").rsplit(".", 1)[1]) if m else None  # layers.L.mlp.experts.J.
        params.append(Param(name, tuple(p.shape), split_of(name, cfg), expert, n_experts,
                            not UNTRAINED.match(name), p.element_size()))
    parts, by_key = model.stage_parts(), {}
    for p in params:  # a block's parameters under one key (its stage holds all or none of them), in order
        head, _, rest = p.name.partition(".")
        by_key.setdefault(f"{head}.{rest.partition('.')[0]}" if head == parts["blocks"] else p.name, []).append(p.name)

    def stages(pp: int) -> list[list[str]]:
        cut = [stage_of(cfg, pp, s, v, pp_layers) for s in range(pp)]
        return [[n for k, names in by_key.items() if holds(parts, stage, k) for n in names] for stage in cut]
    return StateTable(params, stages, bucket_numel)
