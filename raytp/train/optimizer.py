"""AdamW over data-parallel replicas: replicated (``zero`` 0) or sharded over DP (``zero`` 1, ZeRO-1).

One object does a step's data-parallel part for both: the gradients of a
shard's parameters are laid out flat in buckets (raytp.parallel.zero_plan),
summed over DP, clipped by the global norm and applied.

- ``zero`` 0: each bucket is all-reduced; every replica updates every weight
  (torch's AdamW on the whole parameters) and keeps all the moments.
- ``zero`` 1 (Megatron's distributed optimizer): each bucket is
  reduce-scattered, so DP rank d receives the summed gradients of the rows it
  owns only; it keeps AdamW moments for those rows only (torch's AdamW on
  views of them), updates them, and the bucket is all-gathered so every
  replica has every new weight again. Training state: 8 + 8/dp bytes per
  fp32 parameter instead of 16.

Both compute the gradient norm from each DP rank's owned rows, summed over DP,
and reduce the same flat buffers (gloo's reduce-scatter is an all-reduce and a
slice), so zero 0 and zero 1 take the same steps, bit for bit on gloo:
AdamW's update is elementwise, and a view of a row block updates exactly as
the whole tensor does.

The state in *parameter space* (``named_state``): per parameter name, the
AdamW tensors this rank keeps; under zero 1 those of rows ``rows(name)`` of
the parameter only. Snapshots, checkpoints and restores read and write it
through ``named_state`` / ``load_param_state``.
"""
from __future__ import annotations

import torch

from raytp.train.grad_buckets import GradBuckets
from raytp.train.weight_gather import WeightGather
from raytp.parallel.zero_plan import BUCKET_NUMEL, Bucket, owned_rows, plan
from raytp.train.hyper import Hyper


class DistributedAdamW:
    """AdamW of one shard (one rank's parameters), replicated or sharded over its DP group."""

    def __init__(self, model: torch.nn.Module, h: Hyper, dp: int = 1, dp_rank: int = 0, zero: int = 0,
                 bucket_numel: int = BUCKET_NUMEL, overlap: bool = False, overlap_gather: bool = False,
                 apart=None):
        # `apart(name)`: the parameters reduced over another group than DP (experts over expert-DP, with expert
        # parallelism): in buckets of their own, whole (``reduce_apart``; overlapped with the backward pass as the
        # DP buckets are, ``arm``); zero 1 does not shard them (each rank keeps the whole AdamW state of the
        # experts it holds: they are already split over EP).
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # a router's bias is not trained
        if apart is not None:
            named = [(n, p) for n, p in named if not apart(n)] + [(n, p) for n, p in named if apart(n)]
        self.n_bucketed = len(named) if apart is None else sum(1 for n, _ in named if not apart(n))
        self.model, self.overlap_gather = model, overlap_gather
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._index = {n: i for i, n in enumerate(self.names)}
        self.h, self.zero, self.bucket_numel, self.overlap = h, zero, bucket_numel, overlap
        self.dp = self.dp_rank = self.grads = self.gather = None
        self._flats: list[torch.Tensor] = []  # zero 1: each bucket's buffer, from the reduce to the gather
        apart_params = self.params[self.n_bucketed:]
        self.apart = GradBuckets(apart_params, plan([tuple(p.shape) for p in apart_params], 1, bucket_numel),
                                 scatter=False) if apart_params else None
        self.recut(dp, dp_rank)

    def recut(self, dp: int, dp_rank: int) -> None:
        """Keep the rows of DP rank `dp_rank` of `dp` from now on, with no AdamW state yet (a DP resize under
        zero 1 fills it with ``put_rows``; at construction there is none)."""
        self.settle()
        self.dp = None
        self.sharded = bool(self.zero) and dp > 1
        self.follow(dp, dp_rank)
        if self.sharded:  # leaves whose data are views of the owned rows: AdamW updates them in place
            self.targets = {}
            for i, (a, b) in self.owned.items():
                leaf = torch.nn.Parameter(torch.empty(0, dtype=self.params[i].dtype, device=self.params[i].device))
                leaf.data = self.params[i].data[a:b]
                self.targets[i] = leaf
            self.targets.update((i, self.params[i]) for i in range(self.n_bucketed, len(self.params)))
        else:
            self.targets = dict(enumerate(self.params))
        h = self.h
        decay = [t for i, t in self.targets.items() if self.params[i].dim() >= 2]
        no_decay = [t for i, t in self.targets.items() if self.params[i].dim() < 2]
        cuda = self.params[0].is_cuda  # fused: one kernel for the whole update on a GPU
        self.inner = torch.optim.AdamW([{"params": decay, "weight_decay": h.weight_decay},
                                        {"params": no_decay, "weight_decay": 0.0}],
                                       lr=h.lr, betas=(h.beta1, h.beta2), foreach=False, fused=cuda or None)

    def follow(self, dp: int, dp_rank: int) -> None:
        """Cut the rows for DP rank `dp_rank` of `dp` (again, after a live DP resize at zero 0; the state
        of whole parameters does not change). Under zero 1 the cut is fixed: its rows' state is all it has."""
        if (dp, dp_rank) == (self.dp, self.dp_rank):
            return
        if self.sharded and self.dp is not None:
            raise ValueError(f"the distributed optimizer's rows are cut for DP={self.dp}; it cannot follow "
                             f"DP={dp} in place")
        self.dp, self.dp_rank = dp, dp_rank
        bucketed = self.params[:self.n_bucketed]  # the parameters apart come last, outside the buckets
        self.buckets: list[Bucket] = plan([tuple(p.shape) for p in bucketed], dp, self.bucket_numel)
        self.owned = owned_rows(self.buckets, dp_rank)  # index -> (first row, end row)
        if self.grads is not None:
            self.grads.close()
        if self.gather is not None:
            self.gather.close()
        self.grads = GradBuckets(bucketed, self.buckets, self.sharded)
        self.gather = WeightGather(bucketed, self.buckets, dp_rank) if self.sharded else None
        if self.gather is not None and self.overlap_gather:
            self.gather.hook(self.model)

    # -- what torch's optimizer offers that callers use -------------------------------------------
    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = False) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # -- the step -------------------------------------------------------------------------------
    def arm(self, group, backwards: int, hold=(), apart_group=None) -> None:
        """Overlap this step's DP reduction with its backward pass (raytp.train.grad_buckets): each bucket is
        reduced over `group` once its parameters have accumulated `backwards` gradients; buckets holding a
        parameter in `hold` wait for ``reduce_gradients``. The parameters apart likewise over `apart_group`
        (when there is one: the experts' over expert-DP)."""
        held = {id(p) for p in hold}
        if group is not None:
            self.grads.arm(group, backwards, frozenset(i for i, p in enumerate(self.params) if id(p) in held))
        if apart_group is not None and self.apart is not None:
            self.apart.arm(apart_group, backwards)

    def reduce_gradients(self, group, scale: float) -> None:
        """Sum the gradients over the DP `group` (then * scale): every rank's whole gradients (zero 0), or
        the owned rows' only (zero 1, into the leaves' ``.grad``)."""
        self.settle()  # a parameter no forward pass used may still be being gathered
        self._flats = []
        for b, flat in zip(self.buckets, self.grads.finish(group)):
            if self.sharded:  # in place: this rank's chunk of the bucket received its rows' sums
                at = self.dp_rank * b.chunk
                mine = flat[at:at + b.chunk]
                mine *= scale
                self._flats.append(flat)  # the all-gather of the new weights reuses it
                for pc in b.ranges[self.dp_rank]:
                    t = self.targets[pc.index]
                    t.grad = mine[pc.at:pc.at + pc.numel].view(t.shape)
            else:
                if scale != 1.0:
                    flat *= scale
                for d, pieces in enumerate(b.ranges):
                    for pc in pieces:
                        g = self.params[pc.index].grad
                        if g is None:
                            continue
                        g[pc.start:pc.stop].copy_(flat[b.span(d, pc)].view_as(g[pc.start:pc.stop]))

    def reduce_apart(self, group, scale: float) -> None:
        """Sum the gradients of the parameters apart over `group` (then * scale): in their buckets (those the
        backward pass did not launch now), or, with no group, only scaled."""
        if self.apart is None:
            return
        if group is None:
            for p in self.apart.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            return
        for b, flat in zip(self.apart.buckets, self.apart.finish(group)):
            flat *= scale
            for pc in b.ranges[0]:
                g = self.apart.params[pc.index].grad
                if g is not None:
                    g[pc.start:pc.stop].copy_(flat[b.span(0, pc)].view_as(g[pc.start:pc.stop]))

    def apart_grads(self):
        """(name, parameter, gradient) of the parameters apart (whole on every rank that holds them)."""
        for i in range(self.n_bucketed, len(self.params)):
            if self.params[i].grad is not None:
                yield self.names[i], self.params[i], self.params[i].grad

    def update_grads(self):
        """(parameter, the gradient its update reads) for each parameter with one: the whole gradient at zero
        0, the owned rows' at zero 1 (after ``reduce_gradients``)."""
        for i, t in self.targets.items():
            if t.grad is not None:
                yield self.params[i], t.grad

    def owned_grads(self):
        """(name, parameter, gradient of the rows this DP rank owns) for every owned block: what the global
        norm sums (over DP)."""
        for i, (a, b) in self.owned.items():
            p = self.params[i]
            if p.grad is None and not self.sharded:
                continue
            g = self.targets[i].grad if self.sharded else p.grad[a:b]
            if g is not None:
                yield self.names[i], p, g

    def scale_gradients(self, coef: torch.Tensor) -> None:
        """Multiply the gradients the update reads by `coef` (the clip)."""
        for i, t in self.targets.items():
            if t.grad is not None:
                t.grad.mul_(coef)

    def step(self, group=None) -> None:
        """Update what this rank owns, then (zero 1) give every replica the new weights: at once, or, with
        `overlap_gather`, during the next forward pass (raytp.train.weight_gather)."""
        self.inner.step()
        if not self.sharded:
            return
        flats, self._flats = self._flats, []
        for b, flat in zip(self.buckets, flats):  # the gradients' buffers, their chunks read by the update
            at = self.dp_rank * b.chunk
            mine = flat[at:at + b.chunk]
            for pc in b.ranges[self.dp_rank]:
                mine[pc.at:pc.at + pc.numel].copy_(self.targets[pc.index].data.reshape(-1))
        self.gather.start(flats, group)
        if not self.overlap_gather:
            self.gather.settle()

    def abandon(self) -> None:
        """Forget the collectives in flight (a step failed: its process groups are being destroyed, and a work
        object kept would keep its group's sockets open). The weights of an abandoned gather are not whole:
        the state is restored from a replica, a snapshot or a checkpoint after such a failure anyway."""
        self._flats = []
        for buckets in (self.grads, self.apart):
            if buckets is not None:
                buckets.abandon()
        if self.gather is not None:
            self.gather.abandon()

    def settle(self) -> None:
        """Finish giving this replica every new weight (zero 1 with ``overlap_gather``: what the forward pass
        has not yet): before anything but a forward pass reads the weights."""
        if self.gather is not None:
            self.gather.settle()

    # -- the state in parameter space -----------------------------------------------------------
    def rows(self, name: str) -> tuple[int, int] | None:
        """The rows of parameter `name` whose AdamW state this rank keeps: None for all of them (zero 0),
        else (first, end) (zero 1; end == first when it keeps none)."""
        i = self._index[name]
        if not self.sharded or i >= self.n_bucketed:  # or a parameter apart: whole
            return None
        return self.owned.get(i, (0, 0))

    def named_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{parameter name: {"step", "exp_avg", "exp_avg_sq"}} of the state this rank keeps (live tensors)."""
        out = {}
        for i, t in self.targets.items():
            st = self.inner.state.get(t)
            if st:
                out[self.names[i]] = dict(st)
        return out

    def load_param_state(self, name: str, state: dict[str, torch.Tensor], whole: bool = False) -> None:
        """Set parameter `name`'s AdamW state from `state` (copies): of the rows this rank keeps, or, with
        `whole`, of the whole parameter (this rank takes its rows of it)."""
        i = self._index[name]
        if i not in self.targets:
            return
        t = self.targets[i]
        a, b = self.owned[i] if (whole and self.sharded and i < self.n_bucketed) else (0, None)
        out = {}
        for k, v in state.items():
            if k == "step" or v.dim() == 0:
                out[k] = v.clone()
            else:
                v = v[a:b]
                if tuple(v.shape) != tuple(t.shape):
                    raise ValueError(f"{name}/{k}: state has shape {tuple(v.shape)}, this rank keeps "
                                     f"{tuple(t.shape)}")
                out[k] = v.to(t.device, copy=True)
        self.inner.state[t] = out

    def state_of(self, name: str) -> dict:
        """The live AdamW state dict of parameter `name` (made empty if it has none yet), to fill in place;
        of the whole parameter at zero 0, of its kept rows under zero 1."""
        return self.inner.state[self.targets[self._index[name]]]

    def put_rows(self, name: str, key: str, start: int, t: torch.Tensor) -> None:
        """Set AdamW state `key` of parameter `name` at its rows start.. from `t` (a copy; "step" whole): rows this
        rank keeps (what raytp.train.zero_handover.rows_for gave it)."""
        state = self.state_of(name)
        if t.dim() == 0:
            state[key] = t.clone()
            return
        target = self.targets[self._index[name]]
        if key not in state:
            state[key] = torch.zeros_like(target.data)
        lo = self.owned.get(self._index[name], (0, 0))[0]
        state[key][start - lo:start - lo + t.shape[0]].copy_(t)

    def clear_state(self) -> None:
        self.inner.state.clear()

    def state_nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for st in self.named_state().values() for v in st.values())


def make_optimizer(model: torch.nn.Module, h: Hyper, dp: int = 1, dp_rank: int = 0, zero: int = 0,
                   bucket_numel: int = BUCKET_NUMEL, overlap: bool = False, overlap_gather: bool = False,
                   apart=None) -> DistributedAdamW:
    """AdamW; matrices and embeddings decay, biases and LayerNorms do not (as nanoGPT); its state
    replicated over the `dp` replicas (`zero` 0) or sharded over them (`zero` 1); `overlap`: the DP reduction
    runs while the backward pass goes on (``arm``); `overlap_gather` (zero 1): the new weights are gathered
    while the next forward pass goes on; `apart(name)`: the parameters reduced over their own group
    (``reduce_apart``: experts over expert-DP)."""
    return DistributedAdamW(model, h, dp, dp_rank, zero, bucket_numel, overlap, overlap_gather, apart)
