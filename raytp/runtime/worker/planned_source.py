"""A worker's side of a state mover's plan (raytp.moves): its tensors by key, exported, and a shard filled.

``state_tensors``: the live tensors of a shard under the table's keys (``model/<name>``,
``optim/<name>/<k>``: its rows of them under zero 1; a tied embedding's copy included, as the table
lists it); ``keyed``: the same of a shard_state (a snapshot's part). A source rank exports its blocks with
raytp.moves.execute.export; ``PlannedSource`` is what a rank fills its shard by: a new, empty one
(``HeldShard.build``), or the one it holds (``HeldShard.take_moves``): the blocks in place from the rank's
old tensors (``own``), the others from the bundles sent to it and the snapshot parts the plan names (refs in
the object store, fetched one at a time).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raytp.moves import execute
from raytp.train.shard_state import unpack_state


def state_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """{key: live tensor} of a shard's weights and the AdamW state it keeps."""
    optimizer.settle()  # the new weights all here (zero 1 may still be gathering them)
    out = {f"model/{n}": p.detach() for n, p in model.named_parameters()}
    out.update({f"optim/{n}/{k}": v for n, st in optimizer.named_state().items() for k, v in st.items()
                if torch.is_tensor(v)})
    return out


def keyed(state: dict) -> dict[str, torch.Tensor]:
    """{key: tensor} of a shard_state (raytp.train.shard_state: {"model": ..., "optim": ...})."""
    out = {f"model/{n}": t for n, t in state["model"].items()}
    out.update({f"optim/{n}/{k}": v for n, st in state.get("optim", {}).items() for k, v in st.items()
                if torch.is_tensor(v)})
    return out


def targets(model, optimizer, keys) -> dict[str, torch.Tensor]:
    """{key: the tensor of an empty shard to write it into} for `keys`; AdamW state entries are made as asked
    (of the rows this rank keeps under zero 1: ``state_of``)."""
    params = dict(model.named_parameters())
    out = {}
    for key in keys:
        section, name, *k = key.split("/")
        if section == "model":
            out[key] = params[name].data
            continue
        state = optimizer.state_of(name)
        if k[0] not in state:
            like = optimizer.target(name).data
            state[k[0]] = torch.zeros((), dtype=torch.float32) if k[0] == "step" else torch.zeros_like(like)
        out[key] = state[k[0]]
    return out


@dataclass(frozen=True)
class PlannedSource:
    """A rank's state by a plan: its `moves` (raytp.moves.planner.Move, those to it), the bundles sent to it
    (`refs`) and the snapshot parts its moves from snapshots read (`parts`: (old rank, ref of its packed
    shard_state))."""
    refs: tuple
    moves: tuple
    parts: tuple = ()
    keeps_own = True  # raytp.runtime.worker.held_shard passes the old shard: the moves in place read it

    def fill(self, model, optimizer, rank: int, tp: int, own=None) -> None:
        mine = [m for m in self.moves if m.in_place]
        if mine and own is None:
            raise ValueError("a plan with moves in place fills a shard from the one it replaces")
        self.fill_from(targets(model, optimizer, {m.key for m in self.moves}),
                       state_tensors(own[0], own[1]) if mine else {})

    def fill_from(self, into: dict, own: dict) -> None:
        """Write the plan's blocks into `into` ({key: tensor}), those in place from `own`."""
        import ray
        execute.fill(into, own, self.moves, (ray.get(ref) for ref in self.refs),
                     ((rank, keyed(unpack_state(ray.get(ref), views=True))) for rank, ref in self.parts))


def export_moves(model, optimizer, moves) -> tuple:
    """The bundles of `moves` (this rank the source of each) to their destinations in ascending order, then
    their sizes in bytes."""
    bundles = execute.export(state_tensors(model, optimizer), moves)
    order = sorted(bundles)
    return (*[bundles[d] for d in order], [int(bundles[d]["data"].nbytes) for d in order])
