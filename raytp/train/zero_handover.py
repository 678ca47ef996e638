"""A DP resize under the distributed optimizer (``zero`` 1): the AdamW rows each rank keeps, handed over to the
ranks of the new DP degree that keep them next (which rows go where: raytp.parallel.zero_plan.handover).

``rows_for`` cuts what an old rank keeps into one bundle per new DP rank; ``take_part`` has a new rank keep its
rows of an old rank's whole part (a snapshot's). Both read and write through the optimizer's own state
(raytp.train.optimizer.DistributedAdamW: ``owned``, ``targets``, ``put_rows``).
"""
from __future__ import annotations

import torch

from raytp.parallel.zero_plan import handover, owned_rows, plan


def _shapes(opt) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in opt.params[:opt.n_bucketed]]  # the bucketed (DP-cut) parameters


def rows_for(opt, dp: int) -> list[list[tuple[str, str, int, int, torch.Tensor]]]:
    """For each DP rank of degree `dp`, the AdamW state of the rows it will keep that optimizer `opt` keeps now,
    as [(name, key, first row, end row, tensor: those rows; "step": 0-d)]. Live views: copy them before the
    state changes."""
    out = []
    for mine in handover(_shapes(opt), opt.dp, opt.dp_rank, dp, opt.bucket_numel):
        entries = []
        for i, (a, b) in mine.items():
            lo = opt.owned[i][0]
            for k, v in opt.inner.state.get(opt.targets[i], {}).items():
                entries.append((opt.names[i], k, a, b, v if v.dim() == 0 else v[a - lo:b - lo]))
        out.append(entries)
    return out


def take_part(opt, state: dict[str, dict[str, torch.Tensor]], old_dp: int, old_rank: int) -> None:
    """Keep, of the AdamW state `state` that DP rank `old_rank` of `old_dp` kept ({name: {key: its rows}}, e.g.
    its snapshot part), the rows optimizer `opt` keeps now."""
    shapes = _shapes(opt)
    old = owned_rows(plan(shapes, old_dp, opt.bucket_numel), old_rank)
    for i, (a, b) in handover(shapes, old_dp, old_rank, opt.dp, opt.bucket_numel)[opt.dp_rank].items():
        for k, v in state.get(opt.names[i], {}).items():
            opt.put_rows(opt.names[i], k, a, v if v.dim() == 0 else v[a - old[i][0]:b - old[i][0]])
