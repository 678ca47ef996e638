"""Job configuration: a YAML file, `--set` overrides on top, one validated object.

    cfg = load("jobs/default.yaml", overrides=["parallel.tp=4", "train.lr=3e-4"])

Precedence is override > file > default. Every field is typed and carries its
help text in `field(metadata={"help": ...})`; checking is driven by those type
hints and metadata, so adding a knob is adding one line. All problems are
collected and raised together as one `ConfigError`, one line each, naming the
file (or `--set`), the dotted key and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import yaml


class ConfigError(Exception):
    """A job file or override is invalid; `.problems` holds one line per problem."""

    def __init__(self, problems: list[str] | str):
        if isinstance(problems, str):  # so the error survives pickling
            problems = problems.splitlines()
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Range:
    """Valid numeric interval for a field, e.g. Range(0, 1, hi_open=True) is [0, 1)."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v: float) -> bool:
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        hi_ok = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return lo_ok and hi_ok  # NaN fails both comparisons, as it should

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return (f"in {'(' if self.lo_open else '['}{self.lo:g}, "
                f"{self.hi:g}{')' if self.hi_open else ']'}")


POSITIVE = Range(0, lo_open=True)
NONNEG = Range(0)
UNIT = Range(0, 1, hi_open=True)  # [0, 1)


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
    dropout: float = _f(0.0, "dropout probability", UNIT)
    init_from: Optional[str] = _f(
        None, "GPT-2 directory in Hugging Face format to start from; "
              "its config overrides the shape keys")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = _f(1, "tensor-parallel degree (ranks that split each layer)", POSITIVE)
    dp: int = _f(1, "data-parallel degree (model replicas)", POSITIVE)
    sequence_parallel: bool = _f(
        False, "shard LayerNorm/dropout activations along the sequence over TP ranks")
    min_dp: Optional[int] = _f(
        None, "elastic floor: when lost workers cannot be replaced, shrink to as few as this many "
              "replicas instead of failing, and grow back to dp when capacity returns; null = never shrink",
        POSITIVE)


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


@dataclass(frozen=True)
class DataConfig:
    source: str = _f(
        "builtin", "'builtin' (Python stdlib source text, byte level), a directory "
                   "of text files, or a nanoGPT .bin of uint16 token ids")
    val_fraction: float = _f(0.1, "fraction of the data held out for validation",
                             Range(0, 1, lo_open=True, hi_open=True))


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
    step_timeout_s: float = _f(300.0, "seconds one optimizer step may take before its workers are "
                                      "checked for a hang", POSITIVE)
    collective_timeout_s: float = _f(120.0, "seconds before a collective gives up",
                                     POSITIVE)


@dataclass(frozen=True)
class RecoveryConfig:
    max_failures: int = _f(3, "worker losses to recover from before the job fails; 0 = fail at the first",
                           NONNEG)
    snapshot_every: int = _f(1, "steps between in-memory snapshots of every shard; 0 = off", NONNEG)
    spares: int = _f(0, "warm spare workers started ahead (torch imported, each holding a worker's "
                        "resources) that take a lost rank's place at once; 0 = none", NONNEG)
    replace_timeout_s: float = _f(120.0, "seconds to wait for a replacement worker to be placed", POSITIVE)
    ping_timeout_s: float = _f(5.0, "seconds a worker may take to answer a liveness check", POSITIVE)


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

    @property
    def world_size(self) -> int:
        return self.parallel.tp * self.parallel.dp

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
        """Plain nested dict; `from_dict(cfg.to_dict()) == cfg`."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------
# Field tables, read once from the dataclasses; they drive parsing, checking
# and describe().

def _fields(cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


_SECTIONS = {k: tp for k, (tp, _) in _fields(JobConfig).items()
             if dataclasses.is_dataclass(tp)}
_LEAVES: dict[str, tuple[Any, dataclasses.Field]] = {}  # dotted key -> (hint, field)
for _k, (_tp, _fd) in _fields(JobConfig).items():
    if _k in _SECTIONS:
        _LEAVES.update({f"{_k}.{n}": hf for n, hf in _fields(_tp).items()})
    else:
        _LEAVES[_k] = (_tp, _fd)
del _k, _tp, _fd

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# PyYAML follows YAML 1.1, where `3e-4` (no dot) is a string, not a float.
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_ACCEPT = {  # base type -> (accepts a parsed YAML value?, what was expected)
    bool: (lambda x: isinstance(x, bool), "true or false"),
    int: (lambda x: isinstance(x, int) and not isinstance(x, bool), "an integer"),
    float: (lambda x: (isinstance(x, (int, float)) and not isinstance(x, bool))
            or (isinstance(x, str) and _FLOAT_RE.fullmatch(x.strip())), "a number"),
    str: (lambda x: isinstance(x, str), "a string"),
}


def _unwrap(tp: Any) -> tuple[type, bool]:
    """Optional[X] -> (X, True); X -> (X, False)."""
    if typing.get_origin(tp) is typing.Union:
        return [a for a in typing.get_args(tp) if a is not type(None)][0], True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _unwrap(tp)
    return base.__name__ + (" or null" if optional else "")


def _show(v: Any) -> str:
    """A value as the user would write it in YAML."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _lit(v: Any) -> str:
    return repr(v) if isinstance(v, str) else _show(v)


def _coerce(value: Any, tp: Any, cli_text: Optional[str]) -> Any:
    """Type a parsed YAML value as `tp`; raises ValueError('expected ..., got ...')."""
    base, optional = _unwrap(tp)
    accepts, expected = _ACCEPT[base]
    if value is None and optional:
        return None
    if accepts(value):
        return base(value)
    if base is str and cli_text is not None and isinstance(value, (int, float)):
        return cli_text  # `--set name=2024` means the string "2024"
    raise ValueError(f"expected {expected}{' or null' if optional else ''}, "
                     f"got {_lit(value)}")


def _at(where: str, key: str) -> str:
    """'jobs/x.yaml: train.lr' or '--set train.lr'."""
    return f"--set {key}" if where == "--set" else f"{where}: {key}"


def _unknown(where: str, key: str) -> str:
    if key in _SECTIONS:
        example = f"{key}.{dataclasses.fields(_SECTIONS[key])[0].name}"
        return f"{_at(where, key)}: is a section; set one of its keys, e.g. {example}"
    head = key.split(".")[0]
    sec, _, leaf = key.partition(".") if head in _SECTIONS else ("", "", head)
    if sec in _SECTIONS:
        valid, scope = [f.name for f in dataclasses.fields(_SECTIONS[sec])], sec
    else:
        valid, scope = [f.name for f in dataclasses.fields(JobConfig)], "the job file"
    close = difflib.get_close_matches(leaf, valid, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{_at(where, key)}: unknown key{hint}; valid keys in {scope}: {', '.join(valid)}"


# --------------------------------------------------------------------------
# Public API

def describe() -> list[tuple[str, str, str, str]]:
    """(dotted key, type name, default, help) for every field, in order."""
    return [(key, _type_name(tp), _show(f.default), f.metadata["help"])
            for key, (tp, f) in _LEAVES.items()]


def load(path: Any, overrides: Iterable[str] = ()) -> JobConfig:
    """Read a YAML job file, apply `--set` overrides, validate."""
    source = str(path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError([f"{source}: cannot read: {e.strerror or e}"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError([f"{source}{at}: invalid YAML: {what}"]) from None
    return from_dict(data, source=source, overrides=overrides)


def from_dict(d: Any, source: str = "<dict>",
              overrides: Iterable[str] = ()) -> JobConfig:
    """Build and validate a JobConfig from a nested dict plus `--set` overrides."""
    if not isinstance(d, (dict, type(None))):
        raise ConfigError([f"{source}: expected a mapping of sections, "
                           f"got {_lit(d)}"])
    problems: list[str] = []
    given: dict[str, tuple[Any, str, Optional[str]]] = {}  # key -> (value, where, cli)
    for sec, body in (d or {}).items():
        if sec in _SECTIONS and isinstance(body, dict):
            pairs = [(f"{sec}.{k}", v) for k, v in body.items()]
        elif sec in _SECTIONS and body is not None:
            problems.append(f"{source}: {sec}: expected a mapping of keys, "
                            f"got {_lit(body)}")
            continue
        else:
            pairs = [] if sec in _SECTIONS else [(str(sec), body)]
        for key, v in pairs:
            if key in _LEAVES:
                given[key] = (v, source, None)
            else:
                problems.append(_unknown(source, key))

    for item in overrides:  # applied in order, after the file: the last one wins
        key, eq, text = (s.strip() for s in str(item).partition("="))
        if not eq:
            problems.append(f"--set {item}: expected KEY=VALUE, e.g. parallel.tp=2")
        elif key not in _LEAVES:
            problems.append(_unknown("--set", key))
        else:
            try:
                given[key] = (yaml.safe_load(text), "--set", text)
            except yaml.YAMLError:
                problems.append(f"--set {key}: cannot parse value {text!r}")

    # A value of the wrong type keeps its default and is kept out of the
    # range and cross-field checks, so each mistake is reported once.
    typed: dict[str, Any] = {}
    bad: set[str] = set()
    for key, (value, where, cli_text) in given.items():
        try:
            typed[key] = _coerce(value, _LEAVES[key][0], cli_text)
        except ValueError as e:
            problems.append(f"{_at(where, key)}: {e}")
            bad.add(key)
    kwargs: dict[str, Any] = {k: v for k, v in typed.items() if "." not in k}
    for sec, cls in _SECTIONS.items():
        kwargs[sec] = cls(**{k.partition(".")[2]: v for k, v in typed.items()
                             if k.startswith(sec + ".")})
    cfg = JobConfig(**kwargs)
    problems += _check(cfg, lambda k: given[k][1] if k in given else source, bad)
    if problems:
        raise ConfigError(problems)
    return cfg


def validate(cfg: JobConfig, source: str = "<config>") -> None:
    """Re-check a config built in code (e.g. after `dataclasses.replace`)."""
    problems = _check(cfg, lambda k: source, set())
    if problems:
        raise ConfigError(problems)


def _divisors(n: int) -> str:
    return ", ".join(str(i) for i in range(1, n + 1) if n % i == 0)


# Cross-field rules: (keys it reads, the first one named in the message; ok(v);
# message(v)), v mapping dotted keys to values. A rule is skipped when any key
# it reads already has a problem of its own.
_RULES: list[tuple[tuple[str, ...], Any, Any]] = [
    (("train.min_lr", "train.lr"),
     lambda v: v["train.min_lr"] <= v["train.lr"],
     lambda v: f"{_show(v['train.min_lr'])} exceeds train.lr={_show(v['train.lr'])}; "
               "valid: 0 <= min_lr <= lr"),
    (("train.warmup_steps", "train.steps"),
     lambda v: v["train.warmup_steps"] <= v["train.steps"],
     lambda v: f"{v['train.warmup_steps']} exceeds train.steps={v['train.steps']}; "
               f"valid: 0 to {v['train.steps']}"),
    (("model.n_head", "model.n_embd"),
     lambda v: v["model.n_embd"] % v["model.n_head"] == 0,
     lambda v: f"{v['model.n_head']} does not divide model.n_embd={v['model.n_embd']}; "
               f"valid n_head: {_divisors(v['model.n_embd'])}"),
    # Attention heads and the MLP's 4*n_embd hidden units are split over TP.
    (("parallel.tp", "model.n_head", "model.n_embd"),
     lambda v: math.gcd(v["model.n_head"], 4 * v["model.n_embd"]) % v["parallel.tp"] == 0,
     lambda v: f"{v['parallel.tp']} does not divide "
               + (f"model.n_head={v['model.n_head']}"
                  if v["model.n_head"] % v["parallel.tp"]
                  else f"4*model.n_embd={4 * v['model.n_embd']}")
               + f"; valid tp: {_divisors(math.gcd(v['model.n_head'], 4 * v['model.n_embd']))}"),
    # Sequence parallelism splits each sequence into tp equal pieces.
    (("parallel.sequence_parallel", "parallel.tp", "model.block_size"),
     lambda v: not v["parallel.sequence_parallel"]
     or v["model.block_size"] % v["parallel.tp"] == 0,
     lambda v: f"needs model.block_size={v['model.block_size']} divisible by "
               f"parallel.tp={v['parallel.tp']}; set it to false or change block_size"),
    (("parallel.min_dp", "parallel.dp"),
     lambda v: v["parallel.min_dp"] is None or v["parallel.min_dp"] <= v["parallel.dp"],
     lambda v: f"{v['parallel.min_dp']} exceeds parallel.dp={v['parallel.dp']}; valid: 1 to {v['parallel.dp']}"),
    (("train.batch_size", "parallel.dp"),
     lambda v: v["train.batch_size"] % v["parallel.dp"] == 0,
     lambda v: f"{v['train.batch_size']} is not divisible by "
               f"parallel.dp={v['parallel.dp']}; valid: a multiple of {v['parallel.dp']}"),
    (("train.micro_batch_size", "train.batch_size", "parallel.dp"),
     lambda v: v["train.micro_batch_size"] is None
     or (v["train.batch_size"] // v["parallel.dp"]) % v["train.micro_batch_size"] == 0,
     lambda v: f"{v['train.micro_batch_size']} does not divide the per-rank batch "
               f"train.batch_size/parallel.dp={v['train.batch_size'] // v['parallel.dp']}; "
               f"valid: {_divisors(v['train.batch_size'] // v['parallel.dp'])}"),
    (("name",),
     lambda v: v["name"] is None or _NAME_RE.fullmatch(v["name"]),
     lambda v: f"{v['name']!r} is not a valid run name; use letters, digits, "
               "'_', '-', '.', starting with a letter or digit"),
]


def _check(cfg: JobConfig, where, bad: set[str]) -> list[str]:
    """Range, choice and cross-field checks; returns problem lines."""
    problems: list[str] = []
    v: dict[str, Any] = {}
    for key, (_, f) in _LEAVES.items():
        sec, _, leaf = key.rpartition(".")
        v[key] = getattr(getattr(cfg, sec) if sec else cfg, leaf)
        valid = f.metadata.get("valid")
        if key in bad or v[key] is None or valid is None:
            continue
        if isinstance(valid, Range) and v[key] not in valid:
            msg = f"{_show(v[key])} is out of range; must be {valid}"
        elif isinstance(valid, tuple) and v[key] not in valid:
            msg = f"{v[key]!r} is not valid; valid: {', '.join(valid)}"
        else:
            continue
        problems.append(f"{_at(where(key), key)}: {msg}")
        bad.add(key)  # skip the cross-field rules that read it
    for keys, ok, message in _RULES:
        if not bad.intersection(keys) and not ok(v):
            problems.append(f"{_at(where(keys[0]), keys[0])}: {message(v)}")
            bad.add(keys[0])  # and skip the rules that follow from it
    return problems
