"""What one worker will need, estimated from the job before anything starts.

Per rank: its slices of the weights, their gradients (and, with replicas, the flat buffers of their sums),
AdamW's two moments (4, 4 (+4) and 8 bytes a parameter in float32; the moments of 1/dp of them under
``parallel.zero: 1``), the activations the micro-batches in flight keep for the backward pass (each layer's
bytes a token: raytp.runtime.activation_bytes; the vocabulary-parallel logits; under bf16 the weights'
bfloat16 copies), the host buffers of in-memory snapshots (two copies of the weights and AdamW state it
keeps on each rank that owns a part), and a fixed allowance for the process (Python, torch, Ray). On cpu
all of it is host memory; on cuda the snapshot buffers and the allowance are host memory and the rest is
the GPU's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from raytp.runtime import activation_bytes

GiB = 1 << 30
PROCESS_BYTES = GiB // 2  # Python, torch, Ray: measured ~0.4 GiB per worker process on CPU
# On a GPU, beyond what the tensors hold: the CUDA context and cuBLAS's workspaces, and the caching allocator's
# reserve over its allocations (a 1.1B Llama and an 8-layer MoE on an H200 reserved 1.06x and 1.03x of this
# estimate's tensors at their peak: bench/gpu_check).
CUDA_CONTEXT_BYTES = GiB
ALLOCATOR_SLACK = 0.05


@dataclass(frozen=True)
class WorkerMemory:
    weights: int
    grads: int
    optimizer: int
    activations: int
    snapshots: int
    device: str

    @property
    def tensors(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def overhead(self) -> int:
        """On a GPU: the CUDA context and the allocator's slack (none counted on cpu: the process allowance)."""
        return 0 if self.device == "cpu" else int(CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK * self.tensors)

    @property
    def on_device(self) -> int:
        return self.tensors + self.overhead

    @property
    def on_host(self) -> int:
        """Host memory of one worker process (all of it on cpu)."""
        return self.snapshots + PROCESS_BYTES + (self.on_device if self.device == "cpu" else 0)

    def parts(self) -> dict[str, int]:
        return {"weights": self.weights, "grads": self.grads, "AdamW": self.optimizer,
                "activations": self.activations, "CUDA context and allocator": self.overhead,
                "snapshot buffers": self.snapshots}

    def line(self) -> str:
        detail = ", ".join(f"{k} {v / GiB:,.2f}" for k, v in self.parts().items() if v)
        where = f"~{self.on_host / GiB:,.1f} GiB host" if self.device == "cpu" else \
            f"~{self.on_device / GiB:,.1f} GiB GPU + ~{self.on_host / GiB:,.1f} GiB host"
        return f"{where} per worker ({detail} GiB)"

    def what_to_change(self) -> str:
        """The keys that shrink the largest part."""
        biggest = max(self.parts(), key=lambda k: self.parts()[k])
        return {"activations": "lower model.block_size or train.micro_batch_size, or raise parallel.cp (each rank "
                               "a part of every sequence)",
                "snapshot buffers": "set recovery.snapshot_every: 0 (no in-memory snapshots)",
                }.get(biggest, "raise parallel.tp (fewer parameters per worker) or use a smaller model")


def estimate(cfg, documents: bool = False) -> WorkerMemory:
    """The memory of one worker of job `cfg` (a JobConfig): of the largest pipeline stage's. `documents`: its data
    packs documents the attention must not cross though data.document_mask is off (a dataset of conversations:
    the same mask, from the dataset's boundaries)."""
    return max((_stage_memory(cfg, s, documents) for s in range(cfg.parallel.pp)), key=lambda w: w.on_device)


def _stage_weights(cfg, pp_rank: int) -> tuple[int, int]:
    """(elements of the weights a worker of stage `pp_rank` holds, of them its routed experts' where experts have
    a mesh of their own), as the placement table (raytp.moves.table) gives them to the stage's first rank: each
    tensor's TP (ETP) shard, padding included; the experts of its EP place."""
    from raytp.config.adapters import model_args
    from raytp.models.registry import is_expert_weight
    from raytp.moves.table import model_table
    par, lay = cfg.parallel, cfg.layout
    held = model_table(model_args(cfg), par.pp_virtual, par.pp_layers).held_by(lay, lay.rank(pp=pp_rank), False)
    local = sum(math.prod(h.shape) for h in held.values())
    routed = sum(math.prod(h.shape) for k, h in held.items() if is_expert_weight(k.partition("/")[2]))
    return local, routed if lay.experts_split else 0


def _stage_memory(cfg, pp_rank: int, documents: bool = False) -> WorkerMemory:
    """The memory of a worker of stage `pp_rank`: its layers' state, and the activations of the micro-batches
    1F1B keeps in flight there (pp - pp_rank of them at most; all of its model at pp == 1)."""
    from raytp.config.adapters import model_args
    from raytp.models.stage import stage_of
    from raytp.parallel.sharding import padded_vocab
    m, par, model_cfg = cfg.model, cfg.parallel, model_args(cfg)
    tp = par.tp
    stage = stage_of(model_cfg, par.pp, pp_rank, par.pp_virtual, par.pp_layers)
    local, routed = _stage_weights(cfg, pp_rank)  # experts on a mesh of their own: outside the DP rows
    split = cfg.layout.experts_split
    s, b, h = m.block_size // par.cp, cfg.micro_batch, m.n_embd  # the tokens a rank holds of each sequence
    layers = len(stage.layers) if stage else m.n_layer
    in_flight = min(par.pp - pp_rank, cfg.local_batch_size // cfg.micro_batch) if stage else 1
    ids = list(stage.layers) if stage else list(range(m.n_layer))
    if m.arch == "llama":  # a layer's bytes a token, on average over the stage's layers
        per_token = sum(activation_bytes.llama_layer(cfg, model_cfg, i, tp) for i in ids) / max(len(ids), 1)
    else:
        per_token = activation_bytes.gpt2_layer(cfg, tp)
    per_layer = s * b * per_token
    last = stage is None or stage.last
    logits = s * b * padded_vocab(m.vocab_size, tp) / tp * 4 * 3 if last else 0  # logits, softmax, gradient
    if cfg.train.activation_checkpointing:  # kept: each block's fp32 input; one block's worth recomputed
        kept = in_flight * layers * s * b * h * 4 / (tp if cfg.parallel.sequence_parallel else 1) + per_layer
    else:
        kept = in_flight * layers * per_layer
    if cfg.data.document_mask or documents:  # attention with a (b, 1, s, s) mask: SDPA keeps it as a bias, per layer
        kept += in_flight * (1 if cfg.train.activation_checkpointing else layers) * b * s * s * (
            4 if cfg.train.precision == "fp32" else 2)
    # Under bf16 autocast each weight's bfloat16 copy is kept from its matmul to the backward pass (one block's
    # at a time where blocks are recomputed).
    casts = 0 if cfg.train.precision == "fp32" else 2 * local / (max(layers, 1) if cfg.train.activation_checkpointing
                                                                 else 1)
    activations = int(kept + logits + casts + 2 * s * b * h * 4)
    # zero 1: its rows of the dense state, and of its experts' over expert-DP where they are on their own mesh
    lay = cfg.layout
    expert_dp = lay.degree("edp") if split else 1
    adam = 8 * local if not lay.sharded_optimizer else (  # cut over the ranks summing a gradient (DP x CP)
        math.ceil(8 * (local - routed) / lay.grad_degree) + math.ceil(8 * routed / (expert_dp if lay.sharded_experts
                                                                                    else 1)))
    snapshots = 2 * (4 * local + adam) if cfg.recovery.snapshot_every != 0 else 0  # null: on, at some interval
    # The gradients, and with replicas their flat bucket buffers (raytp.train.grad_buckets), all alive at once
    # while they are summed: the dense ones' over DP x CP (under zero 1 a gradient is dropped once in its buffer,
    # kept to the weight gather), the experts' over expert-DP (none where that group is one rank).
    dense_buffers = 0 if lay.grad_degree == 1 or par.zero else 4 * (local - routed)
    expert_buffers = 4 * routed if expert_dp > 1 and not lay.sharded_experts else 0  # cut: a buffer, no gradient
    return WorkerMemory(4 * local, 4 * local + dense_buffers + expert_buffers, adam, activations, snapshots,
                        cfg.runtime.device)


def available_here() -> int:
    """Memory this machine has available now (MemAvailable), bytes."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def pp_that_fits(cfg, node_bytes: int) -> int | None:
    """The fewest pipeline stages (more than the job's) whose largest stage's TP group fits a node of
    `node_bytes` (each stage's TP group on a node of its own), if any."""
    import dataclasses
    for pp in range(cfg.parallel.pp + 1, cfg.model.n_layer + 1):
        par = dataclasses.replace(cfg.parallel, pp=pp, pp_layers=None, pp_virtual=1, pp_schedule="1f1b")
        if estimate(dataclasses.replace(cfg, parallel=par)).on_host * cfg.parallel.tp <= node_bytes:
            return pp
    return None


def zero_fits(cfg, node_bytes: int) -> bool:
    """Whether the job's workers of one node would fit `node_bytes` with the AdamW state sharded over DP
    (parallel.zero: 1), where it is not and there are replicas to shard it over."""
    import dataclasses
    if cfg.parallel.zero or cfg.parallel.dp == 1:
        return False
    par = dataclasses.replace(cfg.parallel, zero=1, min_dp=None)
    return estimate(dataclasses.replace(cfg, parallel=par)).on_host * cfg.parallel.tp <= node_bytes


def refusal(est: WorkerMemory, workers_per_node: int, node_bytes: int, where: str) -> str | None:
    """Why no node can hold the workers it must (None if one can): the estimate, the node's memory, the
    key to change."""
    need = est.on_host * workers_per_node
    if need <= node_bytes:
        return None
    return (f"memory: {workers_per_node} worker(s) on {where} need {need / GiB:,.1f} GiB "
            f"({est.line()}), {where} has {node_bytes / GiB:,.1f} GiB; {est.what_to_change()}")


def fits_device(cfg, where: dict) -> None:
    """Raise DoesNotFit where the largest stage's worker needs more than its GPU has (`where`: a worker's
    identity.where, whose ``device_bytes`` is None without a real GPU), naming the fewest GPUs that fit."""
    from raytp.runtime.errors import DoesNotFit
    have = where.get("device_bytes")
    if cfg.runtime.device != "cuda" or not have:
        return
    need = estimate(cfg)
    if need.on_device <= have:
        return
    layout = fewest_fitting(cfg, have)
    fix = (f"the fewest GPUs that fit: {layout.world_size} at {layout} (parallel.pp, parallel.cp, parallel.dp, "
           "parallel.ep, parallel.zero)" if layout is not None else need.what_to_change())
    raise DoesNotFit(f"memory: a worker needs {need.line()}, its GPU has {have / GiB:,.1f} GiB; {fix}")


def fewest_fitting(cfg, device_bytes: int):
    """The layout with the fewest GPUs, at the job's TP degree, whose largest worker fits `device_bytes`:
    more stages (pp), more replicas to shard the AdamW state over (dp with zero 1), each sequence cut over more
    ranks (cp: the activations divided by it; a long sequence's answer) and, for an MoE job, the experts spread
    further (ep, at the job's etp); None if none up to one layer a stage does."""
    from raytp.config.values import ConfigError
    from raytp.runtime.policy import resized_config
    par, moe = cfg.parallel, cfg.model.moe
    etp = par.etp if par.etp is not None else par.tp
    eps = [e for e in range(1, moe.n_experts + 1) if moe.n_experts % e == 0] if moe is not None else [1]
    cps = sorted({par.cp, *(2 ** i for i in range(7))})  # the config refuses those the sequence does not divide by
    tried = set()
    for pp in range(1, cfg.model.n_layer + 1):
        for ep in eps:
            for cp in cps:
                for dp in {par.dp, max(par.dp, ep * etp // (par.tp * cp))}:
                    for zero in {par.zero, 1 if dp * cp > 1 and par.min_dp is None else par.zero}:
                        tried.add((pp * par.tp * cp * dp, pp, cp, dp, ep, zero))
    for _, pp, cp, dp, ep, zero in sorted(tried):
        try:
            new = resized_config(cfg, cfg.layout.changed(pp=pp, cp=cp, dp=dp, ep=ep, zero=zero))
        except (ConfigError, ValueError):
            continue
        if estimate(new).on_device <= device_bytes:
            return new.layout
    return None
