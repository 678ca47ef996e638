"""Where a run's first state comes from: a checkpoint (--resume), a Hugging Face directory (model.init_from),
or the seeded initialisation. Resolved and checked in the driver's process before any actor starts
(manifests and headers only: the driver reads no tensor), so a bad checkpoint costs nothing; every
worker then reads its own slices (raytp.files.state_sources)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from raytp import config as config_mod
from raytp.config.adapters import model_args
from raytp.models import registry
from raytp.files import checkpoint
from raytp.files.interop import hf
from raytp.files.checkpoint_owner import read_run_id
from raytp.files.state_sources import CheckpointSource, HFSource


def from_checkpoint(location, cfg: config_mod.JobConfig | None = None, warn=None,
                    run_id: str | None = None) -> tuple[int, CheckpointSource, str]:
    """(step, source, where) of the checkpoint at `location` (see raytp.files.checkpoint.find; `run_id`: only
    this run's, or unmarked ones)."""
    found = checkpoint.find(location, model_args(cfg) if cfg is not None else None, warn=warn, run_id=run_id)
    return found.step, CheckpointSource.of(found), found.where


def _experts(job, model, where):
    """The expert layers of a run from a Hugging Face directory: the directory's, with the job's training
    knobs (aux_coeff, z_coeff) when the job gives model.moe; ValueError naming the key where the job's shape
    disagrees with the directory's (or the job asks for experts of a dense model)."""
    if job is None:
        return model
    if model is None:
        raise ValueError(f"model.moe: the model in {where} has no expert layers (its config.json is a dense one)")
    for key in ("n_experts", "top_k", "moe_ffn"):  # the keys a job's model.moe always gives
        if getattr(job, key) != getattr(model, key):
            raise ValueError(f"model.moe.{key}: {getattr(job, key)!r}, but the model in {where} has "
                             f"{getattr(model, key)!r} ({where}/config.json)")
    return dataclasses.replace(model, aux_coeff=job.aux_coeff, z_coeff=job.z_coeff)


def starting_state(cfg: config_mod.JobConfig, resume: str | None, run_dir: Path, say=print, run: str | None = None):
    """(cfg, init_state) where init_state is (step, source, where) or None.

    `resume` is None, "latest" (this run's newest whole checkpoint: in checkpoint.dir, else under
    runtime.storage for run `run`, else in the run dir)
    or a path or URL. With model.init_from, the model's shape comes from the GPT-2 directory and the job
    is validated again (e.g. tp against its head count). Raises CheckpointError, ValueError or ConfigError.
    """
    if resume is not None:
        storage = f"{cfg.runtime.storage.rstrip('/')}/{run}" if cfg.runtime.storage and run else None
        where = (cfg.checkpoint.dir or storage or str(run_dir)) if resume == "latest" else resume
        own = read_run_id(run_dir) if resume == "latest" else None  # its own: never another run's newest
        step, source, found = from_checkpoint(where, cfg, warn=lambda m: say(f"warning: {m}"), run_id=own)
        lay = source.manifest["layout"]
        say(f"resuming from {found} (step {step}, saved at TP={lay['tp']} x DP={lay['dp']})")
        return cfg, (step, source, found)
    if cfg.model.init_from:
        shape = hf.inspect(Path(cfg.model.init_from))
        spec = registry.spec(shape)
        try:  # GPT-2: the position table's length; Llama: the job's, up to the model's
            block = spec.hf.block_size(cfg.model.block_size, shape.block_size)
        except ValueError as e:
            raise ValueError(f"{e} ({cfg.model.init_from}/config.json)") from None
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd,
            block_size=block, vocab_size=shape.vocab_size, arch=shape.arch, n_kv_head=shape.n_kv_head,
            intermediate_size=shape.intermediate_size, rope_theta=shape.rope_theta,
            tie_embeddings=shape.tie_embeddings, norm_eps=shape.norm_eps, rope_scaling=shape.rope_scaling,
            moe=_experts(cfg.model.moe, shape.moe, cfg.model.init_from), head_dim=shape.head_dim,
            qk_norm=shape.qk_norm, qkv_bias=shape.qkv_bias))
        config_mod.validate(cfg, f"{cfg.model.init_from}/config.json")
        say(f"starting from the {spec.title} in {cfg.model.init_from} ({shape.n_layer} layers x {shape.n_embd} wide, "
            f"{shape.n_head} heads, {shape.kv_heads} KV heads, vocabulary {shape.vocab_size})")
        return cfg, (0, HFSource(str(Path(cfg.model.init_from).resolve())), str(cfg.model.init_from))
    return cfg, None
