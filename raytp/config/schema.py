"""The job's schema: typed, frozen dataclasses, each field with its help text and valid values.

Every field carries its help text and, optionally, a Range or a tuple of
choices in ``field(metadata=...)``; parsing (raytp.config.parse) and checking
(raytp.config.rules) are driven by those type hints and metadata, so adding a
knob is adding one line here.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from raytp.config.data_mix import Mix
from raytp.config.values import NONNEG, POSITIVE, UNIT, IntList, Range
from raytp.config.tracking import MlflowTarget, WandbTarget
from raytp.models.args import RopeScaling
from raytp.models.moe.args import MoeArgs
from raytp.models.arch import ARCHES
from raytp.parallel.layout import Layout


def _f(default: Any, help: str, valid: Any = None, factory: Any = None):
    """A field with its help text and, optionally, a Range or a tuple of choices."""
    meta = {"help": help, "valid": valid}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = _f(4, "number of transformer blocks", POSITIVE)
    n_head: int = _f(4, "attention heads per block", POSITIVE)
    n_embd: int = _f(128, "embedding width", POSITIVE)
    block_size: int = _f(128, "context length in tokens", POSITIVE)
    vocab_size: int = _f(256, "vocabulary size (padded for TP elsewhere)", POSITIVE)
    dropout: float = _f(0.0, "dropout probability (gpt2 only)", UNIT)
    init_from: Optional[str] = _f(
        None, "a Hugging Face GPT-2 or Llama (or Mistral, Mixtral, Qwen3, Qwen3-MoE) directory (config.json and safetensors, one file or sharded with "
              "an index) to start from; its config sets the shape keys (a Llama keeps the job's block_size, up "
              "to its max_position_embeddings)")
    arch: str = _f("gpt2", "architecture: " + " or ".join(a.summary for a in ARCHES.values()), tuple(ARCHES))
    n_kv_head: Optional[int] = _f(None, "llama: key/value heads (grouped-query attention); null = n_head",
                                  POSITIVE)
    intermediate_size: Optional[int] = _f(None, "llama: SwiGLU hidden width; null = 4*n_embd", POSITIVE)
    rope_theta: float = _f(10000.0, "llama: base of the rotary position embedding", POSITIVE)
    rope_scaling: Optional[RopeScaling] = _f(
        None, "llama: Llama 3.1+'s rescaling of the rotary frequencies, {rope_type: llama3, factor, "
              "low_freq_factor, high_freq_factor, original_max_position_embeddings} (transformers' "
              "rope_scaling); null = unscaled")
    tie_embeddings: bool = _f(False, "llama: the output head shares the token embedding's weight "
                                     "(gpt2 always ties)")
    norm_eps: float = _f(1e-5, "llama: RMSNorm epsilon", POSITIVE)
    head_dim: Optional[int] = _f(None, "llama: width of each attention head (Qwen3's differs from "
                                       "n_embd / n_head); null = n_embd / n_head", POSITIVE)
    qk_norm: bool = _f(False, "llama: an RMSNorm over each query and key head before the rotation (Qwen3)")
    qkv_bias: bool = _f(False, "llama: biases on the query, key and value projections (Qwen2, Qwen2-MoE)")
    moe: Optional[MoeArgs] = _f(
        None, "llama: Mixture-of-Experts layers, {n_experts, top_k, moe_ffn (an expert's SwiGLU width), "
              "moe_every: 1, first_dense: 0 (the first layers kept dense), score: softmax (Mixtral, Qwen) or "
              "sigmoid (DeepSeek), norm_topk: true, routed_scale: 1.0, n_shared: 0, shared_ffn: 0, "
              "shared_gate: false, aux_coeff: 0.0 (per-sequence load-balancing loss), z_coeff: 0.0 (router "
              "z-loss), capacity_factor: null (dropless; else each expert takes its first ceil(T k / E x cf) "
              "choices of each sequence), bias_rate: 0.0 (sigmoid routers: DeepSeek-V3's loss-free balancing "
              "bias, moved by this much each step)}; null = every layer dense")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = _f(1, "tensor-parallel degree (ranks that split each layer)", POSITIVE)
    pp: int = _f(1, "pipeline stages: the layers split into pp consecutive groups, each stage's TP group "
                    "inside one node, the stages across nodes", POSITIVE)
    dp: int = _f(1, "data-parallel degree (model replicas)", POSITIVE)
    pp_schedule: str = _f("1f1b", "pipeline schedule: 1f1b (Megatron's), or interleaved (pp_virtual model "
                                  "chunks per stage: a smaller bubble, more point-to-point traffic)",
                          ("1f1b", "interleaved"))
    pp_virtual: int = _f(1, "model chunks per stage for pp_schedule: interleaved", POSITIVE)
    pp_layers: Optional[IntList] = _f(None, "layers of each stage (of each model chunk with pp_virtual > 1), "
                                            "e.g. [3, 2]; null = balanced by cost, the embedding counted on "
                                            "the first stage and the head and loss on the last")
    sequence_parallel: bool = _f(
        False, "shard LayerNorm/dropout activations along the sequence over TP ranks")
    zero: int = _f(0, "distributed optimizer: 0 = every DP replica keeps all the AdamW state; 1 = each DP rank "
                      "keeps the AdamW state of its 1/dp of the parameters' rows (ZeRO-1: 8 + 8/dp bytes a "
                      "parameter instead of 16)", (0, 1))
    overlap_grad_reduce: bool = _f(
        True, "sum each gradient bucket over the DP replicas while the backward pass goes on (the same "
              "bits as after it: Megatron's overlap_grad_reduce)")
    tp_overlap: bool = _f(
        True, "in the backward pass, sum each TP entry's input gradient over TP (all-reduce, or reduce-scatter "
              "under sequence parallelism) while the weight gradients behind it are computed (Megatron's "
              "async gradient all-reduce; the same bits)")
    overlap_param_gather: bool = _f(
        False, "under zero: 1, gather the updated weights while the next forward pass goes on, each layer "
               "waiting only for its own (Megatron's overlap_param_gather; the same bits)")
    ep: int = _f(1, "expert-parallel degree (models with model.moe): each expert layer's experts spread over ep "
                    "ranks, folded over the dp x tp ranks of each stage; tokens reach them by all-to-all", POSITIVE)
    etp: Optional[int] = _f(None, "tensor-parallel degree inside an expert: 1 (whole experts, each TP rank routing "
                                  "its share of the tokens) or tp; null = tp", POSITIVE)
    cp: int = _f(1, "context-parallel degree: each sequence cut over cp ranks (2 x cp chunks, each rank an early and "
                    "a late one, for the causal mask's balance), the weights replicated over them, dense gradients "
                    "summed over dp x cp", POSITIVE)
    cp_attention: str = _f("ring", "attention over the cp ranks: ring (keys and values passed round the group) or "
                                   "ulysses (all-to-all to a share of the heads: query and KV heads per TP rank "
                                   "must divide by cp)", ("ring", "ulysses"))
    min_dp: Optional[int] = _f(
        None, "elastic floor: when lost workers cannot be replaced, shrink to as few as this many "
              "replicas instead of failing, and grow back to dp when capacity returns; null = never shrink",
        POSITIVE)
    max_dp: Optional[int] = _f(
        None, "elastic ceiling: grow DP live up to this many replicas as capacity joins the cluster (nodes added "
              "or back), asking the autoscaler for it; null = dp (no growth beyond it)", POSITIVE)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(200, "optimizer steps to run", POSITIVE)
    batch_size: int = _f(16, "global sequences per optimizer step", POSITIVE)
    micro_batch_size: Optional[int] = _f(
        None, "sequences per forward/backward on one DP rank; "
              "null = batch_size // dp (no accumulation)", POSITIVE)
    lr: float = _f(1e-3, "peak learning rate", POSITIVE)
    min_lr: float = _f(1e-4, "final learning rate of the cosine schedule", NONNEG)
    warmup_steps: int = _f(20, "linear warmup steps", NONNEG)
    lr_schedule: str = _f("cosine", "learning-rate schedule after warmup",
                          ("cosine", "constant"))
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only)", NONNEG)
    beta1: float = _f(0.9, "AdamW beta1", UNIT)
    beta2: float = _f(0.95, "AdamW beta2", UNIT)
    grad_clip: float = _f(1.0, "global gradient-norm clip; 0 = off", NONNEG)
    seed: int = _f(1337, "random seed for weights and data order", NONNEG)
    eval_interval: int = _f(50, "steps between validation runs; 0 = never", NONNEG)
    eval_steps: int = _f(4, "batches per validation run", POSITIVE)
    steps_per_call: int = _f(10, "optimizer steps each worker runs per driver call",
                             POSITIVE)
    precision: str = _f("fp32", "fp32, or bf16: bfloat16 compute (and TP activation collectives) with float32 "
                                "master weights, AdamW state, gradient reduction, softmax, loss and norms",
                        ("fp32", "bf16"))
    activation_checkpointing: bool = _f(
        False, "recompute each block's activations in the backward pass instead of keeping them "
               "(less memory, about one more forward of compute)")


@dataclass(frozen=True)
class DataConfig:
    source: str = _f(
        "builtin", "'builtin' (Python stdlib source text, byte level), a directory of text files, a dataset "
                   "`raytp prepare` wrote (a directory or URL), a nanoGPT .bin of token ids, or a Megatron-LM "
                   "indexed dataset's .bin (its .idx beside it)")
    val_fraction: float = _f(0.1, "fraction of each source's documents held out for validation (spread over "
                                  "it; a source without document boundaries: its tail)",
                             Range(0, 1, lo_open=True, hi_open=True))
    tokenizer: Optional[str] = _f(
        None, "a Hugging Face tokenizer.json, or a directory holding one (e.g. model.init_from's), that "
              "text sources are encoded with (once, cached beside the data); null = byte level")
    dtype: Optional[str] = _f(None, "the id type of a nanoGPT .bin data.source (uint32 for vocabularies past "
                                    "65,536); null = uint16, or, with a Megatron-LM .idx beside the .bin, "
                                    "the index's", ("uint16", "uint32"))
    mix: Optional[Mix] = _f(None, "sources blended by weight, {SOURCE: weight, ...} (each one a data.source "
                                  "could name; exact proportions per step); replaces data.source")
    val_source: Optional[str] = _f(None, "a separate validation set (any data.source); null = hold out "
                                         "data.val_fraction of each source's documents")
    document_mask: bool = _f(False, "attention does not cross end-of-document tokens (documents packed in one "
                                    "sequence do not see each other)")
    eod_id: Optional[int] = _f(None, "the end-of-document token id, for data.document_mask; null = the "
                                     "prepared dataset's (or the tokenizer's)", NONNEG)
    packing: bool = _f(True, "conversations (a prepared dataset of them): whole conversations first-fit into "
                             "each row, attention and positions restarting at each; false = one per row, padded")
    too_long: str = _f("truncate", "conversations: one longer than model.block_size + 1 tokens is cut to it "
                                   "(truncate) or left out (drop), either counted on the start line; or the job "
                                   "is refused before it starts (refuse)", ("truncate", "drop", "refuse"))
    bad_rows: str = _f("skip", "conversations: rows prepare left out (no assistant turn, an unknown role, a "
                               "template that does not render) are counted and skipped (skip), or the dataset "
                               "is refused before the run starts (refuse)", ("skip", "refuse"))


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = _f(0, "steps between checkpoints; 0 = never", NONNEG)
    keep: int = _f(3, "checkpoints to keep (oldest deleted first)", Range(1))
    dir: Optional[str] = _f(None, "checkpoint directory; null = <run dir>/checkpoints")


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = _f("cpu", "'cpu' (gloo) or 'cuda' (nccl)", ("cpu", "cuda"))
    cpus_per_worker: float = _f(1.0, "Ray CPUs reserved per worker", POSITIVE)
    gpus_per_worker: Optional[float] = _f(
        None, "Ray GPUs reserved per worker; null = 1 for cuda, 0 for cpu "
              "(1 with cpu places workers on GPU nodes while computing on CPU)", NONNEG)
    threads_per_worker: int = _f(1, "torch threads per worker; 0 = torch default",
                                 NONNEG)
    placement_timeout_s: float = _f(60.0, "seconds to wait for workers to be placed",
                                    POSITIVE)
    step_timeout_s: float = _f(300.0, "seconds one optimizer step may take before its workers are checked for a "
                                      "hang (the last resort: recovery.hang_s finds a stopped rank first)", POSITIVE)
    collective_timeout_s: float = _f(120.0, "seconds before a collective gives up",
                                     POSITIVE)
    peak_tflops: Optional[float] = _f(None, "peak dense bf16 TFLOP/s of one device, for MFU; null = from the "
                                            "device's name (known GPUs; none on cpu: TFLOP/s only)", POSITIVE)
    storage: Optional[str] = _f(None, "a shared path or URL where the run directory's records (config.yaml, "
                                      "metrics.jsonl, events.jsonl, driver.log) are mirrored as they are "
                                      "written, under "
                                      "<storage>/<run>/ (and its checkpoints written, unless checkpoint.dir is "
                                      "set): `raytp status RUN --storage` reads them after the head is gone; "
                                      "null = none")
    orphan_timeout_s: float = _f(600.0, "a run joined to a cluster that no client (raytp train, raytp attach) "
                                        "has followed for this long is stopped with a checkpoint", POSITIVE)
    detached: bool = _f(False, "a run joined to a cluster trains on with no client following it (stop it "
                               "with raytp stop)")
    straggler_ratio: float = _f(1.2, "a rank whose step compute time stays above this many times the median "
                                     "rank's for 5 steps in a row is named in a straggler event", POSITIVE)


@dataclass(frozen=True)
class RecoveryConfig:
    max_failures: int = _f(3, "worker losses to recover from before the job fails; 0 = fail at the first",
                           NONNEG)
    snapshot_every: Optional[int] = _f(
        None, "steps between in-memory snapshots of every shard; null = chosen by the runtime so that snapshots "
              "cost at most recovery.snapshot_budget of the step time; 0 = off", NONNEG)
    snapshot_budget: float = _f(0.03, "the share of step time in-memory snapshots may cost when their interval "
                                      "is chosen by the runtime (recovery.snapshot_every: null)", UNIT)
    spares: int = _f(0, "warm spare workers started ahead (torch imported, each holding a worker's "
                        "resources) that take a lost rank's place at once; 0 = none", NONNEG)
    replace_timeout_s: float = _f(120.0, "seconds to wait for a replacement worker to be placed", POSITIVE)
    ping_timeout_s: float = _f(5.0, "seconds a worker may take to answer a liveness check", POSITIVE)
    hang_s: float = _f(0.5, "while a step runs longer than the ones before it, a rank that answers no ping for "
                            "this long while every other rank answers (quickly) is hung, and replaced at once; "
                            "0 = hangs are found by runtime.step_timeout_s and recovery.ping_timeout_s only",
                       NONNEG)


@dataclass(frozen=True)
class TrackingConfig:
    tensorboard: Optional[str] = _f(None, "a TensorBoard log directory (local, or a storage URL it is copied to) "
                                          "the run's step and event records also go to; null = none")
    wandb: Optional[WandbTarget] = _f(None, "a Weights & Biases run, {project, entity, name}: the run's records "
                                            "also go there (its id kept in the run dir: --resume goes on with it)")
    mlflow: Optional[MlflowTarget] = _f(None, "an MLflow run, {uri, experiment}: the run's records also go "
                                              "there (its id kept in the run dir: --resume goes on with it)")


@dataclass(frozen=True)
class ProfileConfig:
    steps: Optional[IntList] = _f(
        None, "[first, last]: the steps (numbered as metrics.jsonl numbers them) that torch.profiler traces, both "
              "included; null = no profile")
    ranks: IntList = _f(IntList((0,)), "the ranks that trace them, each writing <checkpoint.dir, else <run "
                                       "dir>/checkpoints>/profiles/steps-<first>-<last>/rank<NNN>.json")
    memory: bool = _f(False, "also record memory: allocations in the trace (profile_memory) and, on cuda, a CUDA "
                             "memory snapshot rank<NNN>-memory.pickle (pytorch.org/memory_viz)")


@dataclass(frozen=True)
class JobConfig:
    name: Optional[str] = _f(None, "run name; null = derived from the run directory")
    model: ModelConfig = _f(None, "model shape", factory=ModelConfig)
    parallel: ParallelConfig = _f(None, "parallel layout", factory=ParallelConfig)
    train: TrainConfig = _f(None, "optimization", factory=TrainConfig)
    data: DataConfig = _f(None, "training data", factory=DataConfig)
    checkpoint: CheckpointConfig = _f(None, "checkpointing", factory=CheckpointConfig)
    runtime: RuntimeConfig = _f(None, "Ray and torch runtime", factory=RuntimeConfig)
    recovery: RecoveryConfig = _f(None, "fault recovery", factory=RecoveryConfig)
    profile: ProfileConfig = _f(None, "torch.profiler traces of chosen steps", factory=ProfileConfig)
    tracking: TrackingConfig = _f(None, "experiment trackers", factory=TrackingConfig)

    @property
    def layout(self) -> Layout:
        """The mesh the job asks for (raytp.parallel.layout): every degree, named."""
        return Layout.of(self.parallel)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def local_batch_size(self) -> int:
        """Sequences per optimizer step on one DP rank."""
        return self.train.batch_size // self.parallel.dp

    @property
    def micro_batch(self) -> int:
        return self.train.micro_batch_size or self.local_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.local_batch_size // self.micro_batch

    def to_dict(self) -> dict:
        """Plain nested dict (lists as lists: YAML and JSON write it); `from_dict(cfg.to_dict()) == cfg`."""
        return dataclasses.asdict(self, dict_factory=lambda kv: {
            k: list(v) if isinstance(v, IntList) else v.as_dict() if isinstance(v, Mix) else v for k, v in kv})


# Field tables, read once from the dataclasses; they drive parsing, checking and describe().

def fields_of(cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


SECTIONS = {k: tp for k, (tp, _) in fields_of(JobConfig).items()
             if dataclasses.is_dataclass(tp)}
LEAVES: dict[str, tuple[Any, dataclasses.Field]] = {}  # dotted key -> (hint, field)
for _k, (_tp, _fd) in fields_of(JobConfig).items():
    if _k in SECTIONS:
        LEAVES.update({f"{_k}.{n}": hf for n, hf in fields_of(_tp).items()})
    else:
        LEAVES[_k] = (_tp, _fd)
del _k, _tp, _fd
