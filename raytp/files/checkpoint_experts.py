"""Which tensors a rank writes into a checkpoint when a model's experts have a mesh of their own (expert
parallelism, or whole experts on each TP rank), and their entries in the manifest's table.

Dense tensors are written as always, by replica 0 (raytp.files.checkpoint). A routed expert's tensors (its
weights and AdamW state, under its global name) are written once, by the first rank of the expert-DP group
holding them (raytp.parallel.placements.expert_placement), into that rank's own file
(``shard_file(tp, stage, dp)``): every TP rank of that group its slice where experts are split over TP
(``etp == tp``; the group's TP rank 0 reports the table entries), or the whole expert where each rank holds
them whole (``etp == 1``; the entry says ``tp: 1`` and the file's ``tp_file``). Every expert entry names the
file's place (``dp``: the rank's DP rank, or with context parallelism its place among the DP x CP ranks,
``Layout.grad_place``: two CP ranks of one replica write two files). Any layout reads them back by name
(raytp.files.checkpoint.Checkpoint.read).

Under the distributed optimizer (``zero`` 1) every DP rank also writes the dense AdamW rows it keeps, as a
dense model's ranks do (raytp.files.checkpoint_blocks); their entries are the zero table the caller adds
(``zero_entries``). An expert's AdamW state is whole on each of its holders and written with its weights, unless
the optimizer cuts it over expert-DP too (``Layout.sharded_experts``): then every member of the group writes
its rows of it into its own file, and the group's first reports their blocks (raytp.files.checkpoint_blocks,
each block naming its member's file).
"""
from __future__ import annotations

import torch

from raytp.files.checkpoint import tensor_table, zero_table
from raytp.files.checkpoint_blocks import MOMENTS, blocks_of
from raytp.models.registry import bucketed, is_expert_weight
from raytp.parallel.layout import Layout
from raytp.moves.owners import Owners
from raytp.parallel.placements import REPLICATE


def is_expert_key(key: str) -> bool:
    """Whether a checkpoint key (``model/<name>``, ``optim/<name>/<state>``) is a routed expert's."""
    return is_expert_weight(key.split("/")[1])


def share(tensors: dict, layout: Layout, rank: int, vocab_size: int, stage: int | None
          ) -> tuple[dict, frozenset, dict | None]:
    """(the tensors `rank` writes, the keys it writes whatever its TP rank (whole experts), its table entries:
    None when it reports none) of a rank's `tensors` (keys as raytp.files.checkpoint.named_tensors')."""
    c, place = layout.coords(rank), layout.grad_place(rank)
    dense = {k: v for k, v in tensors.items() if not is_expert_key(k)
             and (place == 0 or (layout.sharded_optimizer and k.startswith("optim/")))}
    writes, cut = Owners(layout).writes_experts(rank), layout.sharded_experts
    experts = {k: v for k, v in tensors.items() if is_expert_key(k) and (writes or (cut and k.startswith("optim/")))}
    listed = {k: v for k, v in dense.items() if k.startswith("model/") or not layout.sharded_optimizer}
    table = tensor_table(listed, layout.tp, vocab_size, stage) if listed and c.tp == 0 else None
    whole = layout.expert_tp == 1
    if writes and (whole or c.tp == 0):
        shown = {k: v for k, v in experts.items() if not (cut and k.startswith("optim/"))}
        entries = tensor_table(shown, 1 if whole else layout.tp, vocab_size, stage)
        for e in entries.values():
            e["dp"] = place
            if whole:
                e.update(tp=1, tp_file=c.tp)
        if cut:
            entries.update(_cut_entries({k: v for k, v in shown.items() if k.startswith("model/")}, layout, rank,
                                        vocab_size, stage))
        table = {**(table or {}), **entries}
    return {**dense, **experts}, frozenset(experts) if whole else frozenset(), table


def _cut_entries(weights: dict, layout: Layout, rank: int, vocab_size: int, stage: int | None) -> dict:
    """The table entries of the AdamW state of `rank`'s experts (`weights`: their ``model/`` keys, in the
    optimizer's order) cut over its expert-DP group by the distributed optimizer: each moment's rows in blocks
    over the members' files, each step count in the file of the holder of its first row."""
    whole = layout.expert_tp == 1
    at = {a: layout.coord(rank, a) for a in ("ep", "etp", "pp")}
    members = [layout.rank_at(edp=d, **at) for d in range(layout.degree("edp"))]
    files = [(layout.grad_place(r), layout.coords(r).tp) for r in members]  # each member's file: (place, tp)
    virtual = {}
    for key, (s, t) in weights.items():
        name = key.split("/", 1)[1]
        virtual.update({f"optim/{name}/{k}": (s, t) for k in MOMENTS})
        virtual[f"optim/{name}/step"] = (REPLICATE, torch.zeros((), dtype=torch.float32))
    table = tensor_table(virtual, 1 if whole else layout.tp, vocab_size, stage)
    for key, blk in zip(weights, blocks_of([tuple(t.shape) for _, t in weights.values()], layout.degree("edp"))):
        name = key.split("/", 1)[1]
        blocks = [[files[d][0], a, b] + ([files[d][1]] if whole else []) for d, a, b in blk]
        first = files[blk[0][0]]
        for k in MOMENTS:
            table[f"optim/{name}/{k}"].update(blocks=blocks, **({"tp": 1} if whole else {}))
        table[f"optim/{name}/step"].update(dp=first[0], **({"tp": 1, "tp_file": first[1]} if whole else {}))
    return table


def zero_entries(params: dict, cfg, layout: Layout, rank: int, stage: int | None, copy: str | None) -> dict:
    """The table entries of the dense AdamW rows under the distributed optimizer (raytp.files.checkpoint
    zero_table), reported by DP rank 0's TP rank 0 of each stage; `params`: the shard's parameters by name (the
    optimizer's buckets are cut over the dense trained ones, raytp.models.registry.bucketed); none elsewhere."""
    if not layout.sharded_optimizer or layout.grad_place(rank) or layout.coords(rank).tp:
        return {}
    dense = {n: params[n] for n in bucketed(list(params), layout)}
    return zero_table(dense, cfg, layout.tp, layout.grad_degree, stage, copy)
