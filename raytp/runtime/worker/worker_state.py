"""What a worker holds, and how it comes and goes: the state half of the Worker actor.

A worker's shard (weights and AdamW state) is built empty and filled from a
source (raytp.files.state_sources: a checkpoint, a Hugging Face directory; a live
resize's bundles, raytp.runtime.worker.transfer), copied from a DP replica or a
snapshot (``set_shard``), cut into bundles for a new TP layout
(``export_pieces``), and written to a checkpoint by a thread of its own
(``begin_save``). ``_settle`` waits until nothing reads the live tensors any
more (a snapshot being packed, a file being written) before they change.
"""
from __future__ import annotations

import gc

import torch

from raytp.config.adapters import model_args, hyper
from raytp.parallel.groups import destroy_process_groups
from raytp.parallel.ownership import Ownership
from raytp.models.shard import build_empty_shard, rebind_groups
from raytp.models.stage import copied_name
from raytp.runtime.worker import transfer
from raytp.runtime.worker.background_save import BackgroundSave
from raytp.runtime.worker.transfer import PiecesSource
from raytp.files import checkpoint
from raytp.train.shard_state import load_shard_state, shard_state, unpack_state
from raytp.files.state_sources import StateSource
from raytp.train.step import make_optimizer
from raytp.files.storage import Storage, answer_probe


class WorkerState:
    """The Worker's state methods (it sets model, optimizer, groups, cfg, device, saving and previous)."""

    def _build_from(self, source, own=None) -> None:
        """A new shard at this rank's current TP position (built empty) holding its slices of `source`
        (`own`: the old (model, optimizer, TP rank, TP degree) of a process that reshapes)."""
        self._settle()
        g = self.groups
        self.model = self.optimizer = None
        self.model = build_empty_shard(model_args(self.cfg), g.tp, self.cfg.parallel.sequence_parallel, self.device,
                                       self._stage())
        self._training_modes()
        self.hyper = hyper(self.cfg)
        self.optimizer = make_optimizer(self.model, self.hyper, g.layout.dp, g.dp_rank, g.layout.zero,
                                        overlap=self.cfg.parallel.overlap_grad_reduce,
                                        overlap_gather=self.cfg.parallel.overlap_param_gather)
        source = StateSource(source) if isinstance(source, dict) else source
        # A kept process copies its own slices locally where the bundles leave them out (a TP resize: None)
        keep_own = own is not None and isinstance(source, PiecesSource) and None in source.refs
        extra = {"own": own} if keep_own else {}
        source.fill(self.model, self.optimizer, g.tp_rank, g.layout.tp, **extra)

    def export_pieces(self, new_tp: int, skip: list[int], stages: list | None = None):
        """For a live resize: one bundle per new TP rank j (and new stage, given the new layout's `stages`)
        of the slices of this shard that go there (none for j in `skip`: those this process keeps), then
        the replicated tensors alone, then the bundles' sizes (raytp.runtime.worker.transfer). Call with
        num_returns=new_tp * len(stages or [None]) + 2."""
        g = self.groups
        bundles = transfer.export_pieces(self.model, self.optimizer, g.tp_rank, g.layout.tp, new_tp,
                                         self.cfg.model.vocab_size, set(skip), stages=stages)
        return (*bundles, transfer.replicated(self.model, self.optimizer), [transfer.bundle_bytes(b) for b in bundles])

    def export_rows(self, new_dp: int):
        """A DP resize under zero 1: one bundle per DP rank of `new_dp` of the AdamW rows this rank keeps that
        that rank will keep (raytp.train.optimizer rows_for), then the bundles' sizes. Call with
        num_returns=new_dp + 1."""
        self._settle()
        bundles = [transfer.pack([(f"optim/{n}/{k}", a, a, t) for n, k, a, _, t in rows])
                   for rows in self.optimizer.rows_for(new_dp)]
        return (*bundles, [transfer.bundle_bytes(b) for b in bundles])

    def take_rows(self, refs: list) -> None:
        """Keep the AdamW rows of this rank's DP position in the layout it has joined, filled from the bundles
        `refs` (export_rows' of the ranks that kept them: a DP resize under zero 1, or its rollback)."""
        import ray
        self._settle()
        self.optimizer.recut(self.groups.layout.dp, self.groups.dp_rank)
        for ref in refs:
            for key, start, _, t in transfer.unpack(ray.get(ref)):  # one bundle in memory at a time
                _, name, k = key.split("/")
                self.optimizer.put_rows(name, k, start, t)

    def recut_parts(self, refs: list, old_dp: int, completed: int) -> None:
        """Take the weights and this rank's AdamW rows at its DP position from snapshot parts of old DP ranks
        0.. (`refs`, cut at `old_dp`: each holds the rows its rank kept) as the state after `completed` steps
        (an elastic shrink under zero 1). One part in memory at a time."""
        import ray
        self._settle()
        self.optimizer.recut(self.groups.layout.dp, self.groups.dp_rank)
        for d, ref in enumerate(refs):
            part = unpack_state(ray.get(ref), views=True)
            if d == 0:  # every replica's weights are the same
                load_shard_state(self.model, None, part)
            self.optimizer.take_part(part["optim"], old_dp, d)
        self.completed = completed

    def commit_reshape(self) -> None:
        """The switch took: the old shard kept by `reshape` goes."""
        self.previous = None
        gc.collect()

    def revert(self) -> None:
        """The switch failed: take back the shard `reshape` kept (its process groups come with a rejoin)."""
        if self.previous is not None:
            destroy_process_groups()
            self.cfg, self.rank, self.model, self.optimizer, self.hyper, _ = self.previous
            rebind_groups(self.model, None)
            self.groups, self.previous = None, None

    def get_state(self, weights_only: bool = False) -> dict:
        """This rank's weights and AdamW state (CPU tensors), e.g. for a DP replica to copy; `weights_only`:
        without the AdamW state (a DP replica under zero 1 keeps other rows of it)."""
        if weights_only:
            return {"model": shard_state(self.model, self.optimizer, copy=True)["model"], "optim": {}}
        return shard_state(self.model, self.optimizer)

    def load(self, source, completed: int) -> None:
        """Take this rank's slices of `source` (raytp.files.state_sources) into the shard it has, as the state
        after `completed` steps (a recovery from a checkpoint)."""
        self._settle()
        g = self.groups
        source.fill(self.model, self.optimizer, g.tp_rank, g.layout.tp)
        self.completed = completed

    def begin_save(self, url: str, directory: str) -> dict | None:
        """Start writing this rank's file of a checkpoint into `directory` of storage `url`, in the background
        (raytp.runtime.worker.background_save): from the snapshot of this step if one is packed (training never
        waits for it), else from the live tensors. Replica 0's ranks write their weights; under the
        distributed optimizer every rank writes the AdamW state of its rows. TP rank 0 (of each stage, of
        replica 0) returns its tensor table."""
        self._settle()
        g = self.groups
        held = self.snap_bufs.hold(self.completed)
        stage = g.pp_rank if g.layout.pp > 1 else None  # its files and table entries name the stage
        weights = Ownership(g.layout).writes_weights(g.rank)
        copy = copied_name(self.model.stage_parts(), getattr(self.model, "stage", None))
        kw = {"tp": g.layout.tp, "stage": stage, "dp_rank": g.dp_rank if g.layout.sharded_optimizer else 0}
        if held is not None:
            packed, buf = held
            tensors = checkpoint.without_copies(checkpoint.state_tensors(unpack_state(packed, views=True),
                                                                         model_args(self.cfg)), copy)
            if not weights:
                tensors = {k: v for k, v in tensors.items() if not k.startswith("model/")}
            self.saving = BackgroundSave(Storage(url), directory, tensors, g.tp_rank, torch.device("cpu"),
                                         staged=True, then=lambda: self.snap_bufs.release(buf), **kw)
        else:
            tensors = checkpoint.named_tensors(self.model, self.optimizer, weights=weights)
            self.saving = BackgroundSave(Storage(url), directory, tensors, g.tp_rank, self.device, **kw)
        if g.tp_rank != 0 or not weights:
            return None
        if not g.layout.sharded_optimizer:
            return checkpoint.tensor_table(tensors, g.layout.tp, self.cfg.model.vocab_size, stage)
        table = checkpoint.tensor_table({k: v for k, v in tensors.items() if k.startswith("model/")}, g.layout.tp,
                                        self.cfg.model.vocab_size, stage)
        params = {n: p.detach() for n, p in self.model.named_parameters()}
        table.update(checkpoint.zero_table(params, model_args(self.cfg), g.layout.tp, g.layout.dp, stage, copy))
        return table

    def probe_storage(self, url: str, token: str) -> str | None:
        """Whether this process reaches the checkpoint location as the driver does (None: it does)."""
        return answer_probe(Storage(url), token, self.rank)

    def save_result(self) -> dict:
        """{"file", "bytes"} of the save begun last, once written (raises if the write failed)."""
        return self.saving.wait()

    def _settle(self, snapshot=None) -> None:
        """Wait until nothing reads the live state any more: a snapshot being packed, a file being written."""
        if snapshot is not None:
            snapshot.packed.wait()
        if self.saving is not None:
            self.saving.copied.wait()
        if self.optimizer is not None:
            self.optimizer.settle()  # zero 1 may still be gathering the new weights

    def weights_nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def state_nbytes(self) -> int:
        """Bytes of this rank's weights and optimizer state."""
        return self.weights_nbytes() + self.optimizer.state_nbytes()

    def set_shard(self, state: dict, completed: int, weights_only: bool = False) -> None:
        """Take a shard_state (or a packed one) of this rank's own shape (from a DP replica or a snapshot);
        `weights_only`: its weights, leaving the AdamW state as it is."""
        self._settle()
        load_shard_state(self.model, None if weights_only else self.optimizer, unpack_state(state))
        self.completed = completed
