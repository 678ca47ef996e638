"""A run's checkpoints as the driver keeps them: where they go, the save in flight, committing it.

The workers write (raytp.runtime.worker.background_save): at a step boundary the driver
asks replica 0's ranks to ``begin_save`` into the checkpoint's directory and
training goes on; at the next boundaries it looks whether every rank's file is
written, and then commits: the manifest (from what each rank reports: its
file's size, rank 0's tensor table) written last, then, on a filesystem, the
rename of the hidden temporary directory into place. The driver never holds a
tensor. A failure before the commit leaves no checkpoint of that step (a
directory without a manifest, removed by the next save's pruning) and every
earlier one whole. ``restore`` has every worker read its slices of the newest
one; ``save_snapshot`` writes the newest in-memory snapshot from the object
store by tasks of their own (when the workers are gone).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import ray

from raytp.config.adapters import model_args
from raytp.files import checkpoint
from raytp.files.state_sources import CheckpointSource
from raytp.files import checkpoint_experts, checkpoint_owner
from raytp.models.registry import bucketed
from raytp.files.storage import Storage, StorageError, check_writable, probe_name
from raytp.runtime.errors import FAILURES


@dataclass
class PendingSave:
    step: int
    directory: str            # where the files go (a hidden temporary one on a filesystem)
    table: dict               # tensor table reported by TP rank 0
    results: list             # one ref per writing rank: {"file", "bytes"} once written
    cfg: object               # the job at the layout that wrote it
    t0: float


class Checkpoints:
    def __init__(self, url: str, keep: int, log, run_id: str | None = None):
        """`run_id`: the run's id (raytp.files.checkpoint_owner), in every manifest it commits: it prunes
        and restores only checkpoints marked with it (None: a new id)."""
        self.storage, self.keep, self.log = Storage(url), keep, log
        self.run_id = run_id or checkpoint_owner.new_run_id()
        self.pending: PendingSave | None = None
        self.committed: int | None = None  # step of the newest checkpoint this run committed

    def check_reached(self, group) -> None:
        """Before the first step: every worker must reach this location and see what the driver writes
        there (a local directory of the driver's node is no place for workers on other nodes).
        Raises StorageError naming the ranks that cannot."""
        token = uuid.uuid4().hex[:12]
        check_writable(self.storage)
        self.storage.write_bytes(probe_name(token), token.encode())
        try:
            problems = [p for p in group.state_calls().probe_storage(self.storage.url, token) if p]
            missing = [r for r in range(group.layout.world_size) if not self.storage.exists(probe_name(token, r))]
        finally:
            for name in [probe_name(token)] + [probe_name(token, r) for r in range(group.layout.world_size)]:
                self.storage.remove(name)
        if problems or missing:
            raise StorageError("checkpoint.dir: " + ("; ".join(problems) or
                               f"the driver does not see the files ranks {missing} write at {self.storage.url}")
                               + "; use a shared filesystem or an object store (s3://, gs://)")

    @property
    def last_step(self) -> int | None:
        """The step last saved or being saved (no second save of it is due)."""
        return self.pending.step if self.pending is not None else self.committed

    def begin(self, group, step: int) -> None:
        """Have replica 0's ranks start writing the checkpoint of `step` (returns at once)."""
        if self.pending is not None:
            self.finish(group)
        name = checkpoint.step_dir(step)
        directory = checkpoint_owner.temp_dir(name, self.run_id) if self.storage.local else name
        if not self.storage.local:
            self.storage.remove(directory)  # what a save of this step cut short left
        self.storage.makedirs(directory)
        table, results = group.state_calls().begin_save(self.storage.url, directory)
        self.pending = PendingSave(step, directory, table, results, group.cfg, time.perf_counter())

    def poll(self, group) -> None:
        """Commit the save in flight if every rank has written its file (never waits). One a writer ended
        without (a worker lost, or stopped by a layout change that did not settle it first) is dropped and told
        (`checkpoint_dropped`): the next save is at the next step due; a lost worker is found by the next
        call, not here."""
        if self.pending is not None and group.answered(self.pending.results):
            step = self.pending.step
            try:
                self.finish(group)
            except FAILURES as e:
                self.log.event("checkpoint_dropped", step=step, error=f"{type(e).__name__}: {str(e)[:300]}")

    def finish(self, group) -> str | None:
        """Wait for the save in flight and commit it; its path."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        try:
            written = group.state_calls().fetch(p.results)
        except BaseException:
            self.storage.remove(p.directory)  # what was written of it: no checkpoint of that step
            raise
        files = {w["file"]: w["bytes"] for w in written}
        lay = p.cfg.parallel
        m = checkpoint.manifest(p.step, model_args(p.cfg), lay.tp, lay.dp, files, p.table, lay.pp, lay.zero,
                                self.run_id)
        path = self._commit(p.directory, p.step, m)
        self.log.event("checkpoint", step=p.step, path=path, bytes=sum(files.values()),
                       seconds=time.perf_counter() - p.t0)
        return path

    def drop(self) -> None:
        """Forget the save in flight (a worker was lost): no checkpoint of that step."""
        p, self.pending = self.pending, None
        if p is not None:
            try:
                self.storage.remove(p.directory)
            except Exception:  # noqa: BLE001 - the next save's pruning removes it too
                pass

    def _commit(self, directory: str, step: int, m: dict) -> str:
        import json
        self.storage.write_bytes(f"{directory}/{checkpoint.MANIFEST}", json.dumps(m, indent=1).encode())
        final = checkpoint.step_dir(step)
        if self.storage.local:
            self.storage.commit_dir(directory, final)
        checkpoint_owner.prune(self.storage, self.keep, self.run_id,
                               self.pending.directory if self.pending is not None else None)
        self.committed = step
        return self.storage.path(final) if self.storage.local else f"{self.storage.url.rstrip('/')}/{final}"

    # -- reading -------------------------------------------------------------------------------------
    def save_now(self, group, step: int) -> str:
        """Save step `step` (unless it is the last begun) and wait for it; where it is."""
        if self.last_step != step:
            self.begin(group, step)
        return self.finish(group) or self.newest().where

    def newest(self):
        """The newest whole checkpoint here (a Checkpoint), or None."""
        try:
            return checkpoint.find(self.storage.url, run_id=self.run_id)
        except checkpoint.CheckpointError:
            return None

    def restore(self, group, warn) -> tuple[int, str]:
        """Every worker of `group` reads its slices of the newest whole checkpoint: (its step, where).
        Raises CheckpointError if there is none."""
        found = checkpoint.find(self.storage.url, warn=warn, run_id=self.run_id)
        group.state_calls().load_source(CheckpointSource.of(found), found.step)
        return found.step, found.where

    def save_snapshot(self, group, step: int, parts: list) -> str:
        """Write a snapshot (one ref per TP rank of `group`'s layout, in the object store) as the checkpoint
        of `step`, by a task per rank (the workers may be gone); its path."""
        name = checkpoint.step_dir(step)
        directory = checkpoint_owner.temp_dir(name, self.run_id) if self.storage.local else name
        self.storage.makedirs(directory)
        cfg = group.cfg
        done = group.state_calls().write_snapshot(self.storage.url, directory, parts, write_part_task)
        files = {d["file"]: d["bytes"] for d in done}
        table = {k: v for d in done if d["table"] for k, v in d["table"].items()}
        m = checkpoint.manifest(step, model_args(cfg), cfg.parallel.tp, cfg.parallel.dp, files, table, cfg.parallel.pp,
                                cfg.parallel.zero, self.run_id)
        path = self._commit(directory, step, m)
        self.log.event("checkpoint", step=step, path=path, bytes=sum(files.values()), seconds=0.0,
                       source="snapshot")
        return path


def write_part(url: str, directory: str, packed, layout, rank: int, model_cfg) -> dict:
    """Rank `rank`'s file of a checkpoint from its packed snapshot (run as a task: write_part_task), as that rank
    of `layout` writes it (raytp.runtime.worker.held_shard.HeldShard.begin_save): its TP rank's, of its stage;
    under the distributed optimizer, a DP rank but the first writes its AdamW rows only; `model_cfg`: the
    model's ModelArgs."""
    at = layout.coords(rank)
    tp_rank, tp, pp, dp, sharded = at.tp, layout.tp, layout.pp, layout.grad_degree, layout.sharded_optimizer
    stage = at.pp if pp > 1 else None
    dp_rank = layout.grad_place(rank) if sharded else 0  # the rows' file: its place among the ranks they are cut over
    experts = (layout, rank) if layout.experts_split else None
    from raytp.train.shard_state import unpack_state
    from raytp.models.registry import model_class
    from raytp.models.stage import Stage, copied_name
    here = Stage((), pp, stage, model_cfg.tied) if stage is not None else None  # only whether it holds a copy
    copy = copied_name(model_class(model_cfg).stage_parts(), here)
    state = unpack_state(packed)
    tensors = checkpoint.without_copies(checkpoint.state_tensors(state, model_cfg), copy)
    if experts is not None:  # (layout, rank) of a part whose experts have a mesh of their own
        lay, rank = experts
        tensors, whole, table = checkpoint_experts.share(tensors, lay, rank, model_cfg.vocab_size, stage)
        zero = checkpoint_experts.zero_entries(state["model"], model_cfg, lay, rank, stage, copy)
        table = {**(table or {}), **zero} if zero else table
        out = checkpoint.write_shard(Storage(url), directory, tensors, tp_rank, tp=tp, stage=stage,
                                     dp_rank=lay.grad_place(rank), whole=whole)
        return {**out, "table": table}
    if dp_rank:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("model/")}
    out = checkpoint.write_shard(Storage(url), directory, tensors, tp_rank, tp=tp, stage=stage, dp_rank=dp_rank)
    out["table"] = None
    if tp_rank == 0 and dp_rank == 0:
        weights = {k: v for k, v in tensors.items() if k.startswith("model/")} if sharded else tensors
        out["table"] = checkpoint.tensor_table(weights, tp, model_cfg.vocab_size, stage)
        if sharded:
            params = {n: state["model"][n] for n in bucketed(list(state["model"]))}  # the optimizer's rows
            out["table"].update(checkpoint.zero_table(params, model_cfg, tp, dp, stage, copy))
    return out


write_part_task = ray.remote(num_cpus=0, max_retries=0)(write_part)
