"""The distributed optimizer's new weights given to every DP replica, optionally overlapping the next forward.

After the update each DP rank holds new weights for its own rows only; each
bucket's buffer (raytp.train.grad_buckets, the gradients' buffer reused) gets
the rank's rows in its chunk and is all-gathered in place (raytp.parallel.comm),
then every other rank's rows are copied out of it into the parameters.

``start`` begins the gathers of every bucket asynchronously; ``settle`` waits
for some (or all) and copies their rows out. Without overlap the optimizer
settles at once. With overlap (Megatron's ``overlap_param_gather``), a forward
pre-hook on every module that holds parameters settles the buckets of its own
parameters just before it runs, so the gather of the later buckets goes on
during the forward pass of the earlier layers. Anything else that reads the
weights settles everything first (the optimizer's ``settle``: snapshots,
checkpoints, copies, the next reduction). The bits are the same either way.
"""
from __future__ import annotations

import torch

from raytp.parallel import comm
from raytp.parallel.zero_plan import Bucket


class WeightGather:
    """The weight gathers of one shard's parameters (`params`, in plan order) over `buckets`, for DP rank
    `dp_rank`."""

    def __init__(self, params: list[torch.Tensor], buckets: list[Bucket], dp_rank: int):
        self.params, self.buckets, self.dp_rank = params, buckets, dp_rank
        self.bucket_of = {i: k for k, b in enumerate(buckets) for i in b.params}
        self._pending: dict[int, tuple[torch.Tensor, list]] = {}  # bucket -> (buffer, works)
        self._hooks: list = []
        self.in_forward = 0  # buckets settled by a forward pass's hooks so far

    def start(self, flats: list[torch.Tensor], group) -> None:
        """Begin gathering every bucket's buffer, whose chunk of this rank holds its new rows."""
        for k, flat in enumerate(flats):
            self._pending[k] = (flat, comm.start_all_gather_in_place(flat, group))

    @torch.no_grad()
    def settle(self, buckets=None) -> None:
        """Wait for the gathers of `buckets` (all pending if None) and copy the other ranks' rows out."""
        for k in sorted(self._pending) if buckets is None else sorted(set(buckets) & self._pending.keys()):
            flat, works = self._pending[k]
            for work in works:
                comm.wait(work)
            b = self.buckets[k]
            for d, pieces in enumerate(b.ranges):
                if d == self.dp_rank:
                    continue
                for pc in pieces:
                    p = self.params[pc.index]
                    p.data[pc.start:pc.stop].copy_(flat[b.span(d, pc)].view_as(p.data[pc.start:pc.stop]))
            del self._pending[k]  # only now are its rows whole here

    def abandon(self) -> bool:
        """Drop the gathers in flight (a failed step; see the optimizer's ``abandon``): whether any was (the
        weights then hold this update's own rows and the last one's of the others: neither step's)."""
        torn = bool(self._pending)
        self._pending.clear()
        return torn

    def hook(self, model: torch.nn.Module) -> None:
        """Settle each module's own parameters' buckets right before it runs (overlap with the forward)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        for module in model.modules():
            own = {self.bucket_of[index[id(p)]] for p in module.parameters(recurse=False) if id(p) in index}
            if own:
                self._hooks.append(module.register_forward_pre_hook(
                    lambda _m, _args, own=frozenset(own): self._before(own)))

    def _before(self, own: frozenset[int]) -> None:
        if self._pending:
            pending = len(self._pending)
            self.settle(own)
            self.in_forward += pending - len(self._pending)

    def close(self) -> None:
        """Settle what is pending and remove the hooks (the plan is replaced)."""
        self.settle()
        for h in self._hooks:
            h.remove()
        self._hooks = []
