"""Where a run's first state comes from: a checkpoint (--resume), a GPT-2 directory
(model.init_from), or the seeded initialisation. Resolved and checked in the
driver's process before any actor starts, so a bad checkpoint costs nothing."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from raytp import config as config_mod
from raytp.config.adapters import gpt_config
from raytp.train import checkpoint


def starting_state(cfg: config_mod.JobConfig, resume: str | None, run_dir: Path, say=print):
    """(cfg, init_state) where init_state is (step, full state, source) or None.

    `resume` is None, "latest" (this run dir's newest whole checkpoint) or a path.
    With model.init_from, the model's shape comes from the GPT-2 directory and the
    job is validated again (e.g. tp against its head count). Raises CheckpointError,
    ValueError or ConfigError.
    """
    if resume is not None:
        where = Path(run_dir) if resume == "latest" else Path(resume)
        ckpt, manifest, full = checkpoint.load_latest(where, gpt_config(cfg), warn=lambda m: say(f"warning: {m}"))
        lay = manifest["layout"]
        say(f"resuming from {ckpt} (step {manifest['step']}, saved at TP={lay['tp']} x DP={lay['dp']})")
        return cfg, (manifest["step"], full, str(ckpt))
    if cfg.model.init_from:
        from raytp.train import hf
        shape, state = hf.load_hf(Path(cfg.model.init_from))
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd,
            block_size=shape.block_size, vocab_size=shape.vocab_size))
        config_mod.validate(cfg, f"{cfg.model.init_from}/config.json")
        say(f"starting from the GPT-2 in {cfg.model.init_from} ({shape})")
        return cfg, (0, {"model": state}, str(cfg.model.init_from))
    return cfg, None
