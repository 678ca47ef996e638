"""One set of a shard's parameters summed over one group, and the rows each rank of it keeps AdamW state for.

A shard's trained parameters are in two sets (raytp.train.optimizer): the dense ones, summed over DP, and the
routed experts on a mesh of their own, summed over expert-DP. Each set is laid out flat in buckets cut for the
`degree` ranks of its group (raytp.parallel.zero_plan). *Sharded* (the distributed optimizer, ``zero`` 1, over
a group of more than one rank), rank `rank` keeps, receives and updates its rows of each bucket only: the
buckets are reduce-scattered, its AdamW state is held on views of its rows (``leaves``), and after the update
its rows are all-gathered so every rank of the group has every new weight (raytp.train.weight_gather).
Otherwise every rank keeps every row and the buckets are all-reduced.
"""
from __future__ import annotations

import torch

from raytp.parallel.zero_plan import Bucket, owned_rows, plan
from raytp.train.grad_buckets import GradBuckets
from raytp.train.weight_gather import WeightGather



class RowCut:
    def __init__(self, params: list[torch.Tensor], first: int, degree: int, rank: int, sharded: bool,
                 bucket_numel: int):
        """`params`: the set's parameters in plan order, the optimizer's indices `first`.. of them."""
        self.params, self.first, self.degree, self.rank, self.sharded = params, first, degree, rank, sharded
        self.buckets: list[Bucket] = plan([tuple(p.shape) for p in params], degree, bucket_numel)
        self.owned = {first + i: rows for i, rows in owned_rows(self.buckets, rank).items()}  # index -> rows
        self.grads = GradBuckets(params, self.buckets, sharded)
        self.gather = WeightGather(params, self.buckets, rank) if sharded else None
        self.flats: list[torch.Tensor] = []  # sharded: each bucket's buffer, from the reduction to the gather

    def leaves(self) -> dict[int, torch.nn.Parameter]:
        """index -> what AdamW updates: a leaf whose data is a view of the owned rows (sharded), else the
        parameter itself."""
        if not self.sharded:
            return {self.first + i: p for i, p in enumerate(self.params)}
        out = {}
        for i, (a, b) in self.owned.items():
            p = self.params[i - self.first]
            leaf = torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device))
            leaf.data = p.data[a:b]
            out[i] = leaf
        return out

    def reduce(self, group, scale: float, targets: dict) -> None:
        """Sum the set's gradients over `group` (then * scale): every row back into ``.grad`` (not sharded), or
        this rank's rows into its leaves' ``.grad`` (sharded: views of the buffers, kept for ``publish``); with
        no group (nothing to sum over), only scale them."""
        self.flats = []
        if group is None:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            return
        for b, flat in zip(self.buckets, self.grads.finish(group)):
            if self.sharded:  # in place: this rank's chunk of the bucket received its rows' sums
                mine = flat[self.rank * b.chunk:(self.rank + 1) * b.chunk]
                mine *= scale
                self.flats.append(flat)  # the all-gather of the new weights reuses it
                for pc in b.ranges[self.rank]:
                    t = targets[self.first + pc.index]
                    t.grad = mine[pc.at:pc.at + pc.numel].view(t.shape)
                continue
            if scale != 1.0:
                flat *= scale
            for d, pieces in enumerate(b.ranges):
                for pc in pieces:
                    g = self.params[pc.index].grad
                    if g is not None:
                        g[pc.start:pc.stop].copy_(flat[b.span(d, pc)].view_as(g[pc.start:pc.stop]))

    def publish(self, targets: dict, group, settle: bool) -> None:
        """After the update (sharded): give every rank of `group` this rank's new rows, in the gradients'
        buffers; at once with `settle`, else as the next forward pass reaches them (``gather.hook``)."""
        if not self.sharded:
            return
        flats, self.flats = self.flats, []
        for b, flat in zip(self.buckets, flats):
            mine = flat[self.rank * b.chunk:(self.rank + 1) * b.chunk]
            for pc in b.ranges[self.rank]:
                mine[pc.at:pc.at + pc.numel].copy_(targets[self.first + pc.index].data.reshape(-1))
        self.gather.start(flats, group)
        if settle:
            self.gather.settle()

    @torch.no_grad()
    def settle(self) -> None:
        if self.gather is not None:
            self.gather.settle()

    def abandon(self) -> bool:
        """Forget the collectives in flight: whether a gather of new weights was among them (WeightGather.abandon)."""
        self.flats = []
        self.grads.abandon()
        return self.gather is not None and self.gather.abandon()

    def close(self) -> None:
        self.grads.close()
        if self.gather is not None:
            self.gather.close()


def experts_cut(layout, rank: int) -> dict:
    """make_optimizer's (raytp.train.optimizer) `apart_degree` and `apart_rank` for `rank` of `layout`: its
    expert-DP group's where the distributed optimizer cuts the experts' state over it
    (``layout.sharded_experts``), else one rank."""
    if not layout.sharded_experts:
        return {"apart_degree": 1, "apart_rank": 0}
    return {"apart_degree": layout.degree("edp"), "apart_rank": layout.coord(rank, "edp")}
