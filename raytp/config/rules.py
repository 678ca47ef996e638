"""Checks of a whole job: ranges, choices, and the rules between keys (tp divides the heads, ...)."""
from __future__ import annotations

import importlib.util
from typing import Any

from raytp.config.tracking import LIBRARIES
from raytp.config.schema import LEAVES, JobConfig
from raytp.config.values import ConfigError, Range, at, show
from raytp.models.args import ModelArgs
from raytp.models.arch import ARCHES
from raytp.models.facts import divisors as _divisors
from raytp.names import check_run_name
from raytp.parallel.layout import Layout
from raytp.tp_degrees import tp_degrees


def validate(cfg: JobConfig, source: str = "<config>") -> None:
    """Re-check a config built in code (e.g. after `dataclasses.replace`)."""
    problems = check(cfg, lambda k: source, set())
    if problems:
        raise ConfigError(problems)


def _shape(v) -> tuple[int, int, int, str]:
    """(query heads, KV heads, MLP width, the MLP width's job key) of the model section."""
    args = ModelArgs(n_head=v["model.n_head"], n_embd=v["model.n_embd"], arch=v["model.arch"],
                     n_kv_head=v["model.n_kv_head"], intermediate_size=v["model.intermediate_size"])
    width_key = ARCHES[args.arch].width_key if args.mlp_width != 4 * args.n_embd else "4*model.n_embd"
    return args.n_head, args.kv_heads, args.mlp_width, width_key


def _tp_degrees(v) -> list[int]:
    heads, kv, width, _ = _shape(v)
    return tp_degrees(heads, kv, width)


def _tp_message(v) -> str:
    heads, kv, width, width_name = _shape(v)
    tp = v["parallel.tp"]
    why = [f"does not divide {k}={n}" for k, n in (("model.n_head", heads), (width_name, width)) if n % tp]
    if not why:
        why = [f"neither divides nor is a multiple of model.n_kv_head={kv}"]
    return f"{tp} {why[0]}; valid tp: {', '.join(map(str, _tp_degrees(v)))}"


def _moe_tp_problem(v) -> str | None:
    """Which expert width parallel.tp does not divide (None: it divides them all)."""
    m, tp = v["model.moe"], v["parallel.tp"]
    for key, width in (("moe_ffn", m.moe_ffn), ("shared_ffn", m.shared_width)):
        if width % tp:
            what = key if key == "moe_ffn" else "n_shared * shared_ffn"
            return (f"{tp} does not divide model.moe.{what}={width} (every expert is split over TP like the dense "
                    f"MLP); valid tp: {', '.join(d for d in _divisors(width).split(', ') if int(d) in _tp_degrees(v))}")
    return None


def _experts_problem(v) -> str | None:
    """What is wrong with parallel.ep / parallel.etp (None: nothing)."""
    ep, etp, tp, dp, moe = v["parallel.ep"], v["parallel.etp"], v["parallel.tp"], v["parallel.dp"], v["model.moe"]
    etp_ = tp if etp is None else etp
    if ep == 1 and etp_ == tp:
        return None
    if moe is None:
        return f"ep={ep}, etp={etp_}: expert parallelism needs expert layers (model.moe)"
    if etp_ not in (1, tp):
        return f"etp={etp_} must be 1 or parallel.tp={tp}"
    if moe.n_experts % ep:
        return f"ep={ep} does not divide model.moe.n_experts={moe.n_experts}"
    cp = v["parallel.cp"]
    why = {"parallel.dp": "experts are folded over the ranks of each stage",
           "parallel.max_dp": "an elastic job grows only to a DP its experts fold over"}
    for key, n in (("parallel.dp", dp), ("parallel.max_dp", v["parallel.max_dp"])):
        if n is not None and (n * cp * tp) % (ep * etp_):
            over = f"{key} x parallel.tp" if cp == 1 else f"{key} x parallel.cp x parallel.tp"
            return f"ep={ep} x etp={etp_} must divide {over} = {n * cp * tp} ({why[key]})"
    return None


def _cp_problem(v) -> str | None:
    """What is wrong with parallel.cp / parallel.cp_attention (None: nothing)."""
    from raytp.parallel.context import sequence as context, ulysses
    cp, tp = v["parallel.cp"], v["parallel.tp"]
    if cp == 1:
        return None
    why = context.refusal(v["model.block_size"], cp, tp, v["parallel.sequence_parallel"])
    if why is None and v["parallel.cp_attention"] == "ulysses":
        heads, kv, _, _ = _shape(v)
        why = ulysses.refusal(heads // tp, max(kv // tp, 1), cp)
    return why


def _micro_batches(v) -> int:
    local = v["train.batch_size"] // v["parallel.dp"]
    return local // v["train.micro_batch_size"] if v["train.micro_batch_size"] else 1


def _pp_layers_problem(v) -> str | None:
    """What is wrong with parallel.pp_layers (None: nothing)."""
    split, chunks, n = list(v["parallel.pp_layers"]), v["parallel.pp"] * v["parallel.pp_virtual"], v["model.n_layer"]
    if len(split) != chunks:
        return f"{show(v['parallel.pp_layers'])} has {len(split)} entries; it needs one per model chunk: {chunks}"
    if min(split) < 1:
        return f"{show(v['parallel.pp_layers'])}: every stage needs at least one layer"
    if sum(split) != n:
        return f"{show(v['parallel.pp_layers'])} sums to {sum(split)}, but model.n_layer={n}"
    return None


def _profile_steps_problem(v) -> str | None:
    """What is wrong with profile.steps (None: nothing)."""
    steps, total = list(v["profile.steps"]), v["train.steps"]
    if len(steps) != 2:
        return f"{show(v['profile.steps'])} has {len(steps)} entries; it needs two: [first, last]"
    if not 0 <= steps[0] <= steps[1]:
        return f"{show(v['profile.steps'])}: needs 0 <= first <= last (steps as metrics.jsonl numbers them)"
    if steps[1] >= total:
        return (f"{show(v['profile.steps'])} ends past the run's last step, {total - 1} (train.steps={total}, "
                "numbered from 0)")
    return None


def _profile_ranks_problem(v) -> str | None:
    """What is wrong with profile.ranks (None: nothing)."""
    world = Layout(v["parallel.tp"], pp=v["parallel.pp"], dp=v["parallel.dp"]).world_size
    outside = [r for r in v["profile.ranks"] if not 0 <= r < world]
    if not v["profile.ranks"] or outside:
        what = f"names rank {outside[0]}, but" if outside else "names no rank;"
        return (f"{show(v['profile.ranks'])} {what} the job has {world} rank{'s' if world > 1 else ''} "
                f"(tp x pp x dp); valid: 0 to {world - 1}")
    return None


_MODEL = ("model.n_head", "model.n_embd", "model.arch", "model.n_kv_head", "model.intermediate_size")


# Cross-field rules: (keys it reads, the first one named in the message; ok(v);
# message(v)), v mapping dotted keys to values. A rule is skipped when any key
# it reads already has a problem of its own.
_RULES: list[tuple[tuple[str, ...], Any, Any]] = [
    (("train.min_lr", "train.lr"),
     lambda v: v["train.min_lr"] <= v["train.lr"],
     lambda v: f"{show(v['train.min_lr'])} exceeds train.lr={show(v['train.lr'])}; "
               "valid: 0 <= min_lr <= lr"),
    (("model.n_head", "model.n_embd"),
     lambda v: v["model.n_embd"] % v["model.n_head"] == 0,
     lambda v: f"{v['model.n_head']} does not divide model.n_embd={v['model.n_embd']}; "
               f"valid n_head: {_divisors(v['model.n_embd'])}"),
    # each architecture's own checks (its spec's job_rules), on jobs of that architecture only
    *[((*keys, "model.arch"), (lambda v, ok=ok, arch=arch: v["model.arch"] != arch or ok(v)), message)
      for arch, facts in ARCHES.items() for keys, ok, message in facts.job_rules],
    # Attention heads (query, and key/value) and the MLP's hidden units are split over TP.
    (("parallel.tp", *_MODEL),
     lambda v: v["parallel.tp"] in _tp_degrees(v),
     _tp_message),
    (("model.head_dim", "model.qk_norm", "model.qkv_bias", "model.arch"),
     lambda v: (v["model.head_dim"] is None and not v["model.qk_norm"] and not v["model.qkv_bias"])
     or v["model.arch"] == "llama",
     lambda v: f"head_dim, qk_norm and qkv_bias are the Llama family's; set model.arch: llama "
               f"(got {v['model.arch']!r})"),
    (("model.moe", "model.arch"),
     lambda v: v["model.moe"] is None or v["model.arch"] == "llama",
     lambda v: f"expert layers are the Llama family's; set model.arch: llama (got {v['model.arch']!r})"),
    (("model.moe", "model.n_layer"),
     lambda v: v["model.moe"] is None or any(v["model.moe"].is_moe(i) for i in range(v["model.n_layer"])),
     lambda v: f"first_dense={v['model.moe'].first_dense} and moe_every={v['model.moe'].moe_every} leave none "
               f"of the model.n_layer={v['model.n_layer']} layers an expert layer"),
    (("parallel.tp", "model.moe"),
     lambda v: v["model.moe"] is None or _moe_tp_problem(v) is None,
     lambda v: _moe_tp_problem(v)),
    (("parallel.ep", "parallel.etp", "parallel.tp", "parallel.dp", "model.moe", "parallel.min_dp", "parallel.max_dp",
      "parallel.cp"),
     lambda v: _experts_problem(v) is None,
     lambda v: _experts_problem(v)),
    (("parallel.cp", "parallel.cp_attention", "parallel.tp", "parallel.sequence_parallel", "model.block_size",
      "parallel.pp", "parallel.zero", "model.moe", "parallel.min_dp", "parallel.max_dp", *_MODEL),
     lambda v: _cp_problem(v) is None,
     lambda v: _cp_problem(v)),
    # Sequence parallelism splits each sequence into tp equal pieces.
    (("parallel.sequence_parallel", "parallel.tp", "model.block_size"),
     lambda v: not v["parallel.sequence_parallel"]
     or v["model.block_size"] % v["parallel.tp"] == 0,
     lambda v: f"needs model.block_size={v['model.block_size']} divisible by "
               f"parallel.tp={v['parallel.tp']}; set it to false or change block_size"),
    # An experiment tracker the job names must be importable here (raytp[tracking] installs them all).
    *[((key,), (lambda v, key=key, lib=lib: v[key] is None or importlib.util.find_spec(lib) is not None),
       (lambda v, lib=lib: f"needs the {lib} library, which is not installed here "
                           "(pip install 'raytp[tracking]')"))
      for key, lib in LIBRARIES.items()],
    (("parallel.min_dp", "parallel.dp"),
     lambda v: v["parallel.min_dp"] is None or v["parallel.min_dp"] <= v["parallel.dp"],
     lambda v: f"{v['parallel.min_dp']} exceeds parallel.dp={v['parallel.dp']}; valid: 1 to {v['parallel.dp']}"),
    (("parallel.max_dp", "parallel.dp"),
     lambda v: v["parallel.max_dp"] is None or v["parallel.max_dp"] >= v["parallel.dp"],
     lambda v: f"{v['parallel.max_dp']} is below parallel.dp={v['parallel.dp']}; valid: {v['parallel.dp']} or more"),
    (("parallel.max_dp", "train.batch_size"),
     lambda v: v["parallel.max_dp"] is None or v["train.batch_size"] % v["parallel.max_dp"] == 0,
     lambda v: f"{v['parallel.max_dp']} does not divide train.batch_size={v['train.batch_size']} (the global "
               f"batch is split over the replicas); valid: a divisor of it"),
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
    (("parallel.pp_virtual", "parallel.pp_schedule", "parallel.pp"),
     lambda v: (v["parallel.pp_virtual"] > 1) == (v["parallel.pp_schedule"] == "interleaved" and v["parallel.pp"] > 1)
     or (v["parallel.pp"] == 1 and v["parallel.pp_virtual"] == 1),
     lambda v: f"{v['parallel.pp_virtual']} needs parallel.pp_schedule: interleaved and parallel.pp > 1; "
               "interleaved needs pp_virtual >= 2 (model chunks per stage)"),
    (("parallel.pp", "parallel.pp_virtual", "model.n_layer"),
     lambda v: v["model.n_layer"] >= v["parallel.pp"] * v["parallel.pp_virtual"],
     lambda v: f"{v['parallel.pp']} x parallel.pp_virtual={v['parallel.pp_virtual']} model chunks exceed "
               f"model.n_layer={v['model.n_layer']} (each chunk needs a layer); valid pp: 1 to "
               f"{v['model.n_layer'] // v['parallel.pp_virtual']}"),
    (("parallel.pp_layers", "parallel.pp", "parallel.pp_virtual", "model.n_layer"),
     lambda v: v["parallel.pp_layers"] is None or _pp_layers_problem(v) is None,
     lambda v: _pp_layers_problem(v)),
    (("parallel.pp_schedule", "parallel.pp", "train.batch_size", "parallel.dp", "train.micro_batch_size"),
     lambda v: v["parallel.pp_schedule"] != "interleaved" or _micro_batches(v) % v["parallel.pp"] == 0,
     lambda v: f"interleaved needs the micro-batches per step ({_micro_batches(v)}: train.batch_size / "
               f"parallel.dp / train.micro_batch_size) to be a multiple of parallel.pp={v['parallel.pp']}"),
    (("profile.steps", "train.steps"),
     lambda v: v["profile.steps"] is None or _profile_steps_problem(v) is None,
     lambda v: _profile_steps_problem(v)),
    (("profile.ranks", "parallel.tp", "parallel.pp", "parallel.dp"),
     lambda v: _profile_ranks_problem(v) is None,
     lambda v: _profile_ranks_problem(v)),
    (("data.mix", "data.source"),
     lambda v: v["data.mix"] is None or v["data.source"] == "builtin",
     lambda v: f"replaces data.source ({v['data.source']}): give one of the two (a source may be named in "
               "data.mix itself)"),
    (("name",),
     lambda v: v["name"] is None or check_run_name(v["name"]) is None,
     lambda v: f"{v['name']!r} is not a valid run name; use at most 128 letters, digits, "
               "'_', '-', '.', starting with a letter or digit"),
]


# The keys a model.init_from directory's config.json sets: the checks that read them wait for that shape
# (raytp.runtime.origin checks the job again once it has it), so the job's defaults refuse nothing.
FROM_MODEL = frozenset({"model.n_layer", "model.n_head", "model.n_embd", "model.block_size", "model.vocab_size",
                        "model.arch", "model.n_kv_head", "model.intermediate_size", "model.rope_theta",
                        "model.tie_embeddings", "model.norm_eps", "model.rope_scaling", "model.moe",
                        "model.head_dim", "model.qk_norm", "model.qkv_bias"})


def check(cfg: JobConfig, where, bad: set[str], shape_known: bool = True) -> list[str]:
    """Range, choice and cross-field checks; returns problem lines. A job file with model.init_from is
    checked before its shape is read (shape_known=False): the cross-field checks of the keys the
    directory sets (FROM_MODEL) wait for it."""
    problems: list[str] = []
    v: dict[str, Any] = {}
    deferred = FROM_MODEL if cfg.model.init_from and not shape_known else frozenset()
    for key, (_, f) in LEAVES.items():
        sec, _, leaf = key.rpartition(".")
        v[key] = getattr(getattr(cfg, sec) if sec else cfg, leaf)
        valid = f.metadata.get("valid")
        if key in bad or v[key] is None or valid is None:
            continue
        if isinstance(valid, Range) and v[key] not in valid:
            msg = f"{show(v[key])} is out of range; must be {valid}"
        elif isinstance(valid, tuple) and v[key] not in valid:
            msg = f"{v[key]!r} is not valid; valid: {', '.join(map(str, valid))}"
        else:
            continue
        problems.append(f"{at(where(key), key)}: {msg}")
        bad.add(key)  # skip the cross-field rules that read it
    for keys, ok, message in _RULES:
        if not bad.intersection(keys) and not deferred.intersection(keys) and not ok(v):
            problems.append(f"{at(where(keys[0]), keys[0])}: {message(v)}")
            bad.add(keys[0])  # and skip the rules that follow from it
    return problems


def adjusted(cfg: JobConfig) -> tuple[JobConfig, list[str]]:
    """A job made to run where it asks for something a short run cannot have, and what was changed (for a
    warning each): a warmup longer than the run is shortened to the run (torchtitan does the same)."""
    import dataclasses
    notes = []
    if cfg.train.warmup_steps > cfg.train.steps:
        notes.append(f"train.warmup_steps={cfg.train.warmup_steps} exceeds train.steps={cfg.train.steps}; "
                     f"warming up over all {cfg.train.steps} steps instead")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, warmup_steps=cfg.train.steps))
    return cfg, notes
