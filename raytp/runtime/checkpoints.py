"""A run's checkpoints, as the runtime sees them: saving one from a group, restoring a group from one.

The format (directories, manifest, atomic commit) is raytp.train.checkpoint's;
this is where the runtime decides what goes in and where: the root
(``checkpoint.dir``, default <run dir>/checkpoints), how many are kept, and
the ``checkpoint`` event of each save.
"""
from __future__ import annotations

import time
from pathlib import Path

from raytp.config.adapters import gpt_config
from raytp.train import checkpoint


class Checkpoints:
    def __init__(self, root: Path, keep: int, log):
        self.root, self.keep, self.log = Path(root), keep, log

    def save(self, group, step: int, shards: list[dict] | None = None) -> Path:
        """Write replica 0's shards (or the given ones) of `group` as the checkpoint of `step`."""
        t0 = time.perf_counter()
        lay = group.layout
        path = checkpoint.save(self.root, step, shards or group.shard_states(), gpt_config(group.cfg), lay.tp,
                               lay.dp, self.keep)
        size = sum(f.stat().st_size for f in path.iterdir())
        self.log.event("checkpoint", step=step, path=str(path), bytes=size, seconds=time.perf_counter() - t0)
        return path

    def save_snapshot(self, group, step: int, parts: list) -> Path:
        """Write a snapshot (one ref per TP rank of `group`'s layout) as the checkpoint of `step`."""
        return self.save(group, step, [checkpoint.unpack_state(p) for p in group.fetch(parts)])

    def newest_step(self) -> int | None:
        """The step of the newest checkpoint that looks whole, if any."""
        found = checkpoint.list_checkpoints(self.root)
        return int(checkpoint.STEP_DIR.fullmatch(found[-1].name).group(1)) if found else None

    def newest(self) -> Path | None:
        found = checkpoint.list_checkpoints(self.root)
        return found[-1] if found else None

    def restore(self, group, warn) -> tuple[int, Path]:
        """Give every worker of `group` its slices of the newest whole checkpoint: (its step, its path).
        Raises CheckpointError if there is none."""
        path, manifest, full = checkpoint.load_latest(self.root, warn=warn)
        group.set_state(full)
        return manifest["step"], path
