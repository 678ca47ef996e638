"""AdamW over data-parallel replicas: replicated (``zero`` 0) or sharded over DP (``zero`` 1, ZeRO-1).

One object does a step's data-parallel part for both: a shard's gradients are laid out flat in buckets
(raytp.parallel.zero_plan), summed over DP, clipped by the global norm and applied.

- ``zero`` 0: each bucket is all-reduced; every replica updates every weight (torch's AdamW on the whole
  parameters) and keeps all the moments.
- ``zero`` 1 (Megatron's distributed optimizer): each bucket is reduce-scattered, so DP rank d receives the
  summed gradients of the rows it owns only; it keeps AdamW moments for those rows only (torch's AdamW on views
  of them), updates them, and the bucket is all-gathered so every replica has every new weight again.
  Training state: 8 + 8/dp bytes per fp32 parameter instead of 16.

Both compute the gradient norm from each DP rank's owned rows, summed over DP, and reduce the same flat buffers
(gloo's reduce-scatter is an all-reduce and a slice), so zero 0 and zero 1 take the same steps, bit for bit on
gloo: AdamW's update is elementwise, and a view of a row block updates exactly as the whole tensor does. Routed
experts on a mesh of their own are a second cut (raytp.train.row_cut), summed over expert-DP and, under zero 1,
sharded there. torch's AdamW is built and stepped by raytp.eager_adamw (no torch._dynamo import).

The state in *parameter space* (``named_state``): per parameter name, the AdamW tensors this rank keeps; under
zero 1 those of rows ``rows(name)`` of the parameter only. Snapshots, checkpoints and restores read and write
it through ``named_state`` / ``load_param_state``.
"""
from __future__ import annotations

import torch

from raytp import eager_adamw
from raytp.parallel.zero_plan import BUCKET_NUMEL
from raytp.train.hyper import Hyper
from raytp.train.row_cut import RowCut


class DistributedAdamW:
    """AdamW of one shard (one rank's parameters), replicated or sharded over its DP group."""

    def __init__(self, model: torch.nn.Module, h: Hyper, dp: int = 1, dp_rank: int = 0, zero: int = 0,
                 bucket_numel: int = BUCKET_NUMEL, overlap: bool = False, overlap_gather: bool = False,
                 apart=None, apart_degree: int = 1, apart_rank: int = 0):
        # The arguments: make_optimizer's. The parameters `apart` are a cut of their own (raytp.train.row_cut).
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # a router's bias is not trained
        if apart is not None:
            named = [(n, p) for n, p in named if not apart(n)] + [(n, p) for n, p in named if apart(n)]
        self.n_bucketed = len(named) if apart is None else sum(1 for n, _ in named if not apart(n))
        self.model, self.overlap_gather = model, overlap_gather
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._index = {n: i for i, n in enumerate(self.names)}
        self.h, self.zero, self.bucket_numel, self.overlap = h, zero, bucket_numel, overlap
        self.dp = self.dp_rank = self.dense = None
        self.experts = self.apart = self._apart_group = None  # _apart_group: the experts' last reduction's group
        self.recut(dp, dp_rank, apart_degree, apart_rank)

    def recut(self, dp: int, dp_rank: int, apart_degree: int = 1, apart_rank: int = 0) -> None:
        """Keep the rows of DP rank `dp_rank` of `dp` from now on, with no AdamW state yet (a DP resize under
        zero 1 fills it by the state mover's plan; at construction there is none); the parameters apart (the
        experts) likewise over the `apart_degree` ranks of their expert-DP group."""
        self.settle()
        self.dp = None
        self.sharded = bool(self.zero) and dp > 1
        self.follow(dp, dp_rank)
        apart_params = self.params[self.n_bucketed:]
        if apart_params:
            if self.experts is not None:
                self.experts.close()
            sharded = bool(self.zero) and apart_degree > 1
            self.experts = RowCut(apart_params, self.n_bucketed, apart_degree if sharded else 1,
                                  apart_rank if sharded else 0, sharded, self.bucket_numel)
            self.apart = self.experts.grads
            self._apart_group = None  # (their gather's group, under zero 1)
        self.targets = self.dense.leaves()
        if self.experts is not None:
            self.targets.update(self.experts.leaves())
        h = self.h
        decay = [t for i, t in self.targets.items() if self.params[i].dim() >= 2]
        no_decay = [t for i, t in self.targets.items() if self.params[i].dim() < 2]
        cuda = self.params[0].is_cuda  # fused: one kernel for the whole update on a GPU
        self.inner = eager_adamw.adamw([{"params": decay, "weight_decay": h.weight_decay},
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
        if self.dense is not None:
            self.dense.close()
        # the parameters apart come last, outside the DP buckets
        self.dense = RowCut(self.params[:self.n_bucketed], 0, dp, dp_rank, self.sharded, self.bucket_numel)
        self.buckets, self.owned = self.dense.buckets, self.dense.owned  # index -> (first row, end row)
        self.grads, self.gather = self.dense.grads, self.dense.gather
        if self.gather is not None and self.overlap_gather:
            self.gather.hook(self.model)

    # -- what torch's optimizer offers that callers use -------------------------------------------
    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = False) -> None:
        for p in (p for p in self.params if p.grad is not None):
            p.grad = None if set_to_none else p.grad.zero_()

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
        self.dense.reduce(group, scale, self.targets)

    def reduce_apart(self, group, scale: float) -> None:
        """Sum the gradients of the parameters apart over `group` (then * scale): in their buckets (those the
        backward pass did not launch now), or, with no group, only scaled."""
        if self.experts is None:
            return
        self._apart_group = group
        self.experts.reduce(group, scale, self.targets)

    def apart_cut(self) -> tuple[int, int]:
        """(degree, rank) the experts' rows are cut over now ((1, 0): not cut, or no experts apart)."""
        return (self.experts.degree, self.experts.rank) if self.experts is not None else (1, 0)

    @property
    def apart_sharded(self) -> bool:
        """Whether the parameters apart are cut over their group (zero 1 over an expert-DP group of several)."""
        return self.experts is not None and self.experts.sharded

    @property
    def cuts(self) -> list[RowCut]:
        """The dense parameters' cut, and the parameters apart's where there are any."""
        return [cut for cut in (self.dense, self.experts) if cut is not None]

    def held_buffers(self) -> list[torch.Tensor]:
        """The bucket buffers held from a reduction to the weight gather (zero 1: the kept rows' gradients)."""
        return [f for cut in self.cuts for f in cut.flats]

    def apart_grads(self):
        """(name, parameter, gradient) of the parameters apart: whole on every rank that holds them, or under
        ``apart_sharded`` the rows this rank keeps (what the norm sums over their group)."""
        if self.apart_sharded:
            for i in self.experts.owned:
                if self.targets[i].grad is not None:
                    yield self.names[i], self.params[i], self.targets[i].grad
            return
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
        `overlap_gather`, during the next forward pass (raytp.train.weight_gather); the experts' over their
        group, at once."""
        eager_adamw.step(self.inner)
        if self.sharded:
            self.dense.publish(self.targets, group, settle=not self.overlap_gather)
        if self.apart_sharded:
            self.experts.publish(self.targets, self._apart_group, settle=True)

    def abandon(self) -> bool:
        """Forget the collectives in flight (a step failed: its process groups are being destroyed, and a work
        object kept would keep its group's sockets open). Whether a gather of new weights was among them: the
        weights are then not whole, and the worker takes its state from a replica, a snapshot or a checkpoint."""
        return any([cut.abandon() for cut in self.cuts])

    def settle(self) -> None:
        """Finish giving this replica every new weight (zero 1 with ``overlap_gather``: what the forward pass
        has not yet): before anything but a forward pass reads the weights."""
        for cut in self.cuts:
            cut.settle()

    # -- the state in parameter space -----------------------------------------------------------
    def rows(self, name: str) -> tuple[int, int] | None:
        """The rows of parameter `name` whose AdamW state this rank keeps: None for all of them (zero 0),
        else (first, end) (zero 1; end == first when it keeps none)."""
        cut = self._cut(self._index[name])
        return cut.owned.get(self._index[name], (0, 0)) if cut.sharded else None

    def _cut(self, i: int) -> RowCut:
        return self.dense if i < self.n_bucketed else self.experts

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
        cut = self._cut(i)
        a, b = cut.owned[i] if (whole and cut.sharded) else (0, None)
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

    def target(self, name: str) -> torch.Tensor:
        """What AdamW updates for parameter `name`: the parameter, or the view of the rows this rank keeps
        (zero 1)."""
        return self.targets[self._index[name]]

    def clear_state(self) -> None:
        self.inner.state.clear()

    def state_nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for st in self.named_state().values() for v in st.values())


def make_optimizer(model: torch.nn.Module, h: Hyper, dp: int = 1, dp_rank: int = 0, zero: int = 0,
                   bucket_numel: int = BUCKET_NUMEL, overlap: bool = False, overlap_gather: bool = False,
                   apart=None, apart_degree: int = 1, apart_rank: int = 0) -> DistributedAdamW:
    """AdamW; matrices and embeddings decay, biases and LayerNorms do not (as nanoGPT); its state
    replicated over the `dp` replicas (`zero` 0) or sharded over them (`zero` 1); `overlap`: the DP reduction
    runs while the backward pass goes on (``arm``); `overlap_gather` (zero 1): the new weights are gathered
    while the next forward pass goes on; `apart(name)`: the parameters reduced over their own group
    (``reduce_apart``: experts over expert-DP), whose state zero 1 cuts over the `apart_degree` ranks of their
    group, of which this is `apart_rank` (raytp.train.row_cut.experts_cut)."""
    return DistributedAdamW(model, h, dp, dp_rank, zero, bucket_numel, overlap, overlap_gather, apart,
                            apart_degree, apart_rank)

