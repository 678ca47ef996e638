"""What a worker holds, and how it comes and goes: ``HeldShard``, a rank's shard as a value of its own.

A shard (weights, AdamW state and the knobs that step it) is built seeded, or empty and filled from a
source (raytp.files.state_sources: a checkpoint, a Hugging Face directory; a
state mover's plan, raytp.runtime.worker.planned_source: a live layout change),
filled in place by a plan (``take_moves``: a recovery, a DP change), cut into
bundles by a plan (``export_moves``), and written to a checkpoint by a thread of
its own (``begin_save``). ``settle`` waits until nothing reads the live tensors any
more (a snapshot being packed, a file being written) before they change.

It reads nothing of the Worker actor (raytp.runtime.worker.worker): the rank's process groups, its job and
its snapshot buffers are handed to each call; the Worker holds one and replaces it whole.
"""
from __future__ import annotations

import dataclasses

import torch

from raytp.config.adapters import model_args, hyper
from raytp.moves.owners import Owners
from raytp.models.moe.plan import ExpertPlace
from raytp.models.registry import bucketed, is_expert_weight
from raytp.models.shard import build_empty_shard, build_shard
from raytp.parallel.context import context_attention
from raytp.models.stage import copied_name
from raytp.runtime.worker import planned_source
from raytp.runtime.worker.background_save import BackgroundSave
from raytp.files import checkpoint, checkpoint_experts
from raytp.train.shard_state import shard_state, unpack_state
from raytp.files.state_sources import StateSource
from raytp.parallel.layers import set_tp_overlap
from raytp.train.row_cut import experts_cut
from raytp.train.step import make_optimizer
from raytp.files.storage import Storage


class HeldShard:
    def __init__(self, model, optimizer, hyper, device: torch.device):
        self.model, self.optimizer, self.hyper, self.device = model, optimizer, hyper, device
        self.saving: BackgroundSave | None = None  # this rank's file of the checkpoint being written
        self.before = None  # the AdamW rows take_moves cut anew, until commit or revert

    @classmethod
    def build(cls, cfg, groups, device: torch.device, stage, modes: dict, source=None, own=None) -> "HeldShard":
        """This rank's shard at its place in `groups`: from the seeded initialisation (only its own slices are
        computed), or built empty and holding its slices of `source` (raytp.files.state_sources, a one-device
        state, a resize's bundles; `own`: the old (model, optimizer, TP rank, TP degree) of a process that
        reshapes). `modes`: attributes the job sets on the model (activation checkpointing, the document
        mask)."""
        args, sp = model_args(cfg), cfg.parallel.sequence_parallel
        experts = ExpertPlace.of(groups)  # where its experts are (all of them without an expert mesh)
        if source is None:
            model = build_shard(args, cfg.train.seed, groups.tp, sp, device, stage, experts)
        else:
            model = build_empty_shard(args, groups.tp, sp, device, stage, experts)
        for k, v in modes.items():
            setattr(model, k, v)
        set_tp_overlap(model, cfg.parallel.tp_overlap)
        context_attention.bind(model, groups, cfg.parallel.cp_attention)
        knobs = hyper(cfg)
        optimizer = make_optimizer(model, knobs, groups.layout.grad_degree, groups.grad_rank, groups.layout.zero,
                                   overlap=cfg.parallel.overlap_grad_reduce,
                                   overlap_gather=cfg.parallel.overlap_param_gather,
                                   apart=is_expert_weight if groups.layout.experts_split else None,
                                   **experts_cut(groups.layout, groups.rank))
        if source is not None:
            source = StateSource(source) if isinstance(source, dict) else source
            # A kept process copies its blocks in place from its old shard (a plan's, raytp.moves)
            keep_own = own is not None and getattr(source, "keeps_own", False)
            source.fill(model, optimizer, groups.tp_rank, groups.layout.tp, **({"own": own} if keep_own else {}))
        return cls(model, optimizer, knobs, device)

    def export_moves(self, moves: list):
        """A plan's blocks this shard is the source of (raytp.moves): one bundle per destination rank, in
        ascending order, then their sizes (raytp.runtime.worker.planned_source)."""
        self.settle()
        return planned_source.export_moves(self.model, self.optimizer, moves)

    def take_moves(self, groups, source) -> None:
        """Fill this shard in place by a plan (`source`: planned_source.PlannedSource): the same model at its
        place in `groups` (a recovery, a DP change), its blocks kept or overwritten; under the distributed
        optimizer the AdamW rows are cut again first if its DP place changed (the old rows are kept until
        ``commit``, or taken back by ``revert``)."""
        self.settle()
        own = planned_source.state_tensors(self.model, self.optimizer)
        opt, lay = self.optimizer, groups.layout
        cut = experts_cut(lay, groups.rank)  # the experts' rows over expert-DP (an EP job's DP change)
        now = (opt.dp, opt.dp_rank, *opt.apart_cut())
        if lay.zero and now != (lay.grad_degree, groups.grad_rank, cut["apart_degree"], cut["apart_rank"]):
            self.before = (now, opt.named_state())
            # every row's state is written anew, kept ones too
            opt.recut(lay.grad_degree, groups.grad_rank, cut["apart_degree"], cut["apart_rank"])
        else:
            source = dataclasses.replace(source, moves=tuple(m for m in source.moves if not m.kept))
        source.fill_from(planned_source.targets(self.model, opt, {m.key for m in source.moves}), own)

    def commit(self) -> None:
        """The change that took_moves is part of took: the old rows go."""
        self.before = None

    def revert(self) -> None:
        """The change failed: the AdamW rows cut before take_moves come back (the weights it kept)."""
        if self.before is not None:
            (dp, dp_rank, apart_degree, apart_rank), state = self.before
            self.optimizer.recut(dp, dp_rank, apart_degree, apart_rank)
            for name, st in state.items():
                self.optimizer.state_of(name).update(st)
            self.before = None

    def get_state(self) -> dict:
        """The weights and AdamW state (CPU tensors, copies): what a snapshot holds (bench/snapshots.py)."""
        return shard_state(self.model, self.optimizer)

    def load(self, groups, source) -> None:
        """Take this rank's slices of `source` (raytp.files.state_sources) into this shard (a recovery from a
        checkpoint)."""
        self.settle()
        source.fill(self.model, self.optimizer, groups.tp_rank, groups.layout.tp)

    def begin_save(self, groups, cfg, snap_bufs, completed: int, url: str, directory: str) -> dict | None:
        """Start writing this rank's file of a checkpoint into `directory` of storage `url`, in the background
        (raytp.runtime.worker.background_save): from the snapshot of step `completed` if one is packed in
        `snap_bufs` (training never waits for it), else from the live tensors. The first ranks holding each
        weight write it (raytp.moves.owners); under the distributed optimizer every rank writes the
        AdamW state of its rows, in the file of its place among the ranks the rows are cut over (``grad_place``:
        its replica's, or with context parallelism its replica's and sequence chunk's). TP rank 0 (of each stage,
        of replica 0) returns its tensor table."""
        self.settle()
        g = groups
        held = snap_bufs.hold(completed)
        stage = g.pp_rank if g.layout.pp > 1 else None  # its files and table entries name the stage
        weights = Owners(g.layout).writes_weights(g.rank)
        copy = copied_name(self.model.stage_parts(), getattr(self.model, "stage", None))
        kw = {"tp": g.layout.tp, "stage": stage, "dp_rank": g.grad_rank if g.layout.sharded_optimizer else 0}
        if held is not None:
            packed, buf = held
            tensors = checkpoint.without_copies(checkpoint.state_tensors(unpack_state(packed, views=True),
                                                                         model_args(cfg)), copy)
            if not weights:
                tensors = {k: v for k, v in tensors.items() if not k.startswith("model/")}
            where = {"device": torch.device("cpu"), "staged": True, "then": lambda: snap_bufs.release(buf)}
        else:
            tensors = checkpoint.named_tensors(self.model, self.optimizer, weights=weights)
            where = {"device": self.device}
        table = None
        if g.layout.experts_split:  # dense tensors by replica 0, each expert by its expert-DP group's first
            tensors, kw["whole"], table = checkpoint_experts.share(tensors, g.layout, g.rank, cfg.model.vocab_size,
                                                                   stage)
            params = {n: p.detach() for n, p in self.model.named_parameters()}
            zero = checkpoint_experts.zero_entries(params, model_args(cfg), g.layout, g.rank, stage, copy)
            table = {**(table or {}), **zero} if zero else table
            kw["dp_rank"] = g.grad_rank
        self.saving = BackgroundSave(Storage(url), directory, tensors, g.tp_rank, **where, **kw)
        if g.layout.experts_split or g.tp_rank != 0 or not weights:
            return table
        if not g.layout.sharded_optimizer:
            return checkpoint.tensor_table(tensors, g.layout.tp, cfg.model.vocab_size, stage)
        table = checkpoint.tensor_table({k: v for k, v in tensors.items() if k.startswith("model/")}, g.layout.tp,
                                        cfg.model.vocab_size, stage)
        params = {n: p.detach() for n, p in self.model.named_parameters()}
        params = {n: params[n] for n in bucketed(list(params))}  # the optimizer's rows: trained weights only
        table.update(checkpoint.zero_table(params, model_args(cfg), g.layout.tp, g.layout.grad_degree, stage,
                                               copy))
        return table

    def settle(self, snapshot=None) -> None:
        """Wait until nothing reads the live state any more: a snapshot being packed, a file being written."""
        if snapshot is not None:
            snapshot.packed.wait()
        if self.saving is not None:
            self.saving.copied.wait()
        if self.optimizer is not None:
            self.optimizer.settle()  # zero 1 may still be gathering the new weights
