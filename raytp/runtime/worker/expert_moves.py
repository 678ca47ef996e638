"""A live expert-parallel change's state moving worker to worker: each expert a rank gains, once.

Every worker keeps its process, its dense weights and their AdamW state (TP, PP and DP stay, so its dense
slices and, under zero 1, the rows it keeps are the same). Where zero 1 cuts the experts' state over expert-DP,
whose degree an EP change changes, each rank first gathers its experts' rows over its old expert-DP group, and
each new rank keeps its rows of the whole state at the new one. Each old rank cuts one bundle per global expert
it holds (``export_experts``: that expert's weights and AdamW state in every expert layer of its stage,
under their global names); a new rank rebuilds its shard from its old one (``own``) and, for each expert it
gains, the bundle of the one old rank chosen to give it (raytp.runtime.elastic.rank_plans.expert_sources):
``ExpertsSource``. The bundles live in the object store, owned by the driver, which passes references only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raytp.models.moe.plan import EXPERT_WEIGHT
from raytp.runtime.worker.transfer import bundle_bytes, pack, unpack


def expert_of(name: str) -> int | None:
    """The global index of the routed expert parameter `name` belongs to; None for any other."""
    m = EXPERT_WEIGHT.match(name)
    return None if m is None else int(m.group(0).split(".")[-2])  # layers.<i>.mlp.experts.<j>.


def export_experts(model, optimizer, n_experts: int, group=None) -> list:
    """One bundle per global expert 0..n_experts-1 of what this shard holds of it (empty for one it does
    not hold): [(key, 0, 0, tensor)] for its weights (``model/<name>``) and AdamW state
    (``optim/<name>/<key>``, whole: under zero 1 cut over expert-DP, each rank's rows gathered over its
    expert-DP `group` first), then the bundles' sizes."""
    optimizer.settle()
    state = optimizer.apart_state(group)
    entries: list[list] = [[] for _ in range(n_experts)]
    for name, p in model.named_parameters():
        j = expert_of(name)
        if j is None:
            continue
        entries[j].append((f"model/{name}", 0, 0, p.detach()))
        entries[j] += [(f"optim/{name}/{k}", 0, 0, v) for k, v in state.get(name, {}).items()]
    bundles = [pack(e) for e in entries]
    return (*bundles, [bundle_bytes(b) for b in bundles])


@dataclass(frozen=True)
class ExpertsSource:
    """What a rank's shard is made of after an EP change: its old shard (`own`: (model, optimizer, TP rank,
    TP degree)) for every parameter it still holds, with its AdamW state, and the bundles `refs` of the
    experts it gains."""
    refs: tuple
    keeps_own = True  # raytp.runtime.worker.held_shard passes the old shard

    def fill(self, model, optimizer, rank: int, tp: int, own=None) -> None:
        import ray
        if own is None:
            raise ValueError("an expert-parallel change rebuilds a shard from the one it replaces")
        old_model, old_opt = own[0], own[1]
        old = dict(old_model.named_parameters())
        old_state = old_opt.named_state()
        whole = old_opt.take_exported()  # its experts' state whole, as export_experts took it (gathered where cut)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in params.items():
                if name in old:
                    p.copy_(old[name])
                    if name in whole:
                        optimizer.load_param_state(name, whole[name], whole=True)
                    elif name in old_state:
                        optimizer.load_param_state(name, old_state[name])
            for ref in self.refs:
                got: dict[str, dict] = {}
                for key, _, _, t in unpack(ray.get(ref)):  # one bundle in memory at a time
                    section, name, *k = key.split("/")
                    if name not in params:
                        raise ValueError(f"{key}: sent to a rank that does not hold it")
                    if section == "model":
                        params[name].copy_(t)
                    else:
                        got.setdefault(name, {})[k[0]] = t
                for name, st in got.items():
                    optimizer.load_param_state(name, st, whole=True)  # this rank's rows where they are cut
