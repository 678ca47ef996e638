"""What the TP benchmarks share: the model sizes, the data, the DTensor peer
(the same GPT under ``torch.distributed.tensor.parallel``), one training step of
each implementation, and a counter of the collectives a step issues.

Both implementations start from the same full initialisation (``GPT(cfg, seed=SEED)``) and see the same batches, so their losses
agree up to float rounding. The one difference of layout: raytp slices the
fused ``c_attn`` per q/k/v block (rank i holds [q_i; k_i; v_i]), while
``ColwiseParallel`` gives rank i a contiguous block of rows; the DTensor model's
``c_attn`` rows are therefore permuted so that its contiguous block i is exactly
[q_i; k_i; v_i]. The model code then runs unchanged on the local q, k, v (it
reads the head count off the tensor shapes). The LM head stays tied to the
token embedding in both (in DTensor: both ``Shard(0)``, re-tied after
``parallelize_module``).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from raytp.models.args import ModelArgs
from raytp.models.gpt2.model import GPT
from raytp.parallel.placements import Shard
from raytp.parallel.sharding import shard_tensor
from raytp.data.corpus import Corpus, batch, load_corpus
from raytp.train.hyper import Hyper, lr_at

SEED = 1337


@dataclass(frozen=True)
class Size:
    """A benchmark size: the model, the batch, and how many steps to run."""

    cfg: ModelArgs
    batch_size: int
    warmup: int        # untimed steps per implementation (their losses are compared)
    timed: int         # timed steps per implementation
    tps: tuple[int, ...]


FULL = Size(ModelArgs(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab_size=256, dropout=0.0),
            batch_size=8, warmup=3, timed=40, tps=(2, 4))
QUICK = Size(ModelArgs(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256, dropout=0.0),
             batch_size=4, warmup=2, timed=4, tps=(2,))
HYPER = Hyper(lr=1e-3, lr_schedule="constant", warmup_steps=0, weight_decay=0.1, grad_clip=1.0, seed=SEED)


def size(quick: bool) -> Size:
    return QUICK if quick else FULL


def corpus(quick: bool) -> Corpus:
    """The builtin corpus (stdlib source, byte level); a synthetic one for --quick."""
    if not quick:
        return load_corpus("builtin")
    text = np.random.default_rng(0).integers(0, 256, 1 << 16)
    return Corpus(text, text[:4096], 256, "synthetic")


def batches(data: Corpus, s: Size, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of steps 0..n-1 (every rank holds the whole batch: TP only)."""
    return [batch(data, "train", SEED, step, 0, 1, s.batch_size, s.cfg.block_size) for step in range(n)]


# ---------------------------------------------------------------- DTensor peer

def dtensor_plan(cfg: ModelArgs) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate()),  # vocab-parallel embedding
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # logits stay vocab-sharded
    }
    for i in range(cfg.n_layer):
        plan[f"h.{i}.attn.c_attn"] = ColwiseParallel()
        plan[f"h.{i}.attn.c_proj"] = RowwiseParallel()
        plan[f"h.{i}.mlp.c_fc"] = ColwiseParallel()
        plan[f"h.{i}.mlp.c_proj"] = RowwiseParallel()
    return plan


@torch.no_grad()
def _permute_qkv_rows(model: GPT, tp: int) -> None:
    """Reorder c_attn's rows to [q_0; k_0; v_0; q_1; k_1; v_1; ...] (see module doc)."""
    qkv = Shard(0, parts=3)
    for block in model.h.values():
        for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
            p.copy_(torch.cat([shard_tensor(p, qkv, r, tp) for r in range(tp)]))


def build_dtensor_gpt(cfg: ModelArgs, tp: int) -> GPT:
    """The same GPT as raytp.models.shard.build_shard, parallelized by torch's native TP on the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    if cfg.vocab_size % tp:
        raise ValueError(f"the DTensor peer needs vocab_size divisible by tp (got {cfg.vocab_size}, tp={tp})")
    mesh = init_device_mesh("cpu", (tp,))
    model = GPT(cfg, seed=SEED)
    _permute_qkv_rows(model, tp)
    # src_data_rank=None: every rank holds the same full init and keeps its slice (no scatter).
    parallelize_module(model, mesh, dtensor_plan(cfg), src_data_rank=None)
    model.lm_head.weight = model.wte.weight  # re-tie: both Shard(0) over the vocabulary
    return model


def dtensor_step(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                 step: int, h: Hyper) -> float:
    """One step of the DTensor peer, the same maths as raytp.train.step.train_step (one micro-batch):
    loss under loss_parallel, global-norm clipping (torch's clip_grad_norm_), lr, AdamW."""
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import loss_parallel
    model.train()
    optimizer.zero_grad(set_to_none=True)
    with loss_parallel():
        loss = model(x, y)
        loss.backward()
    if h.grad_clip > 0:
        with implicit_replication():  # LayerNorm / position-embedding grads are plain (replicated) tensors
            torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip)
    lr = lr_at(step, h)
    for g in optimizer.param_groups:
        g["lr"] = lr
    optimizer.step()
    return float(loss.detach().to_local())


# ---------------------------------------------------------------- counting collectives

DIST_COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                    "reduce_scatter_tensor", "all_gather", "reduce_scatter", "broadcast")

# c10d and functional-collective op names -> one spelling
_OP_KIND = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "gather_": "gather", "scatter_": "scatter", "reduce_": "reduce",
}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def collective_counter():
    """A TorchDispatchMode counting collectives at the op level: torch.distributed's c10d ops (what
    raytp calls) and the functional collectives DTensor issues. ``.counts``/``.bytes`` by kind.

    Like torch's CommDebugMode, it returns NotImplemented for DTensor arguments so DTensor
    dispatches first and the mode sees the collectives it desugars into."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts, self.bytes = defaultdict(int), defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            if func.namespace in _COLLECTIVE_NAMESPACES:
                kind = _OP_KIND.get(func._overloadpacket.__name__)
                if kind is not None:
                    self.counts[kind] += 1
                    self.bytes[kind] += _nbytes(args[0]) if args else 0
            return func(*args, **kwargs)

    return CollectiveCounter()


class DistApiCounter:
    """Counts calls of torch.distributed's Python collectives (wraps them while active)."""

    def __init__(self):
        self.counts = defaultdict(int)
        self._originals = {}

    def __enter__(self):
        self._originals = {n: getattr(dist, n) for n in DIST_COLLECTIVES if hasattr(dist, n)}

        def counting(name, fn):
            def wrapper(*a, **k):
                self.counts[name] += 1
                return fn(*a, **k)
            return wrapper

        for n, fn in self._originals.items():
            setattr(dist, n, counting(n, fn))
        return self

    def __exit__(self, *exc):
        for n, fn in self._originals.items():
            setattr(dist, n, fn)


class NoCollectives(DistApiCounter):
    """While active, torch.distributed's Python collectives do nothing (counted, not run): a TP
    step then costs its compute alone; for timing only, its numbers are wrong."""

    def __enter__(self):
        self._originals = {n: getattr(dist, n) for n in DIST_COLLECTIVES if hasattr(dist, n)}

        def skip(name):
            def nothing(*a, **k):
                self.counts[name] += 1
            return nothing

        for n in self._originals:
            setattr(dist, n, skip(n))
        return self


def torch_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """A peer's torch AdamW set as raytp's: HYPER's lr and betas, matrices and embeddings decayed, the rest not."""
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": HYPER.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), foreach=False)


def spawn(world: int, fn, *args, timeout_s: float = 1800, tries: int = 3) -> list:
    """raytp.parallel.spawn.run_ranks, tried again when the rendezvous port it picked was taken
    meanwhile (EADDRINUSE: another program grabbed it between free_port() and the bind)."""
    from raytp.parallel.spawn import run_ranks
    for attempt in range(tries):
        try:
            return run_ranks(world, fn, *args, threads=1, timeout_s=timeout_s)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def timed(fn, group=None) -> tuple[float, object]:
    """(seconds, result) of fn(), started after a barrier so all ranks start together."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out
