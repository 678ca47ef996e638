"""The Worker actor: one per rank, owns its shard of weights and optimizer state.

The driver's WorkerGroup (raytp.runtime.cluster.group) starts it in the rank's bundle,
asks rank 0 for a rendezvous address, then has every rank join at once
(``setup``, ``rejoin`` or ``reshape``: they meet in torch.distributed), and
drives training with streamed ``run_steps`` calls of several steps each, so
Ray's per-call cost stays off the hot path.

The class is plain Python (Ray wraps it when the launcher starts it). The CUDA
path differs from the CPU path only in ``device`` and the backend picked from
it: Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, which is then cuda:0.
"""
from __future__ import annotations

import gc
import importlib
import time

import torch

from raytp.config import from_dict
from raytp.config.adapters import model_args, hyper
from raytp.parallel import comm
from raytp.parallel.groups import destroy_process_groups, init_process_groups, listening_store
from raytp.parallel.layout import Layout
from raytp.models.shard import build_shard, rebind_groups
from raytp.models.stage import stage_of
from raytp.runtime.cluster import relay as relay_calls
from raytp.runtime.worker.background_save import BackgroundSave
from raytp.runtime.worker.calls import Calls, on_thread
from raytp.runtime.worker.identity import WorkerIdentity
from raytp.runtime.errors import WorkerAborted
from raytp.runtime.worker.snapshot_buffers import SnapshotBuffers
from raytp.runtime.worker.forwards import WorkerForwards
from raytp.runtime.worker.profiling import WorkerProfiling
from raytp.runtime.worker.worker_state import WorkerState
from raytp.runtime.worker.process import tune_malloc
from raytp.train.efficiency import peak_memory, peak_tflops
from raytp.train.shard_state import live_state, state_bytes
from raytp.data.corpus import batch, check_ids, document_eod, epochs_read, job_corpus, vocabulary_fits
from raytp.train.stage_runner import PipelineSchedule
from raytp.train.step import make_optimizer, train_step


class Worker(WorkerState, WorkerForwards, WorkerIdentity, WorkerProfiling):
    def __init__(self, job: dict, rank: int):
        tune_malloc()
        self.cfg = from_dict(job)
        self.rank = rank
        threads = self.cfg.runtime.threads_per_worker
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device("cuda", 0) if self.cfg.runtime.device == "cuda" else torch.device("cpu")
        self.peak_tflops = peak_tflops(torch.cuda.get_device_name(0) if self.device.type == "cuda" else None,
                                       self.cfg.runtime.peak_tflops)
        self.groups = self.model = self.optimizer = None
        self.pipeline = None  # raytp.train.stage_runner.PipelineSchedule of this rank's stage, at pp > 1
        self.completed, self.calls = 0, Calls()  # calls: the order of its run_steps calls
        self.snap_bufs = SnapshotBuffers(self.device)
        self.saving: BackgroundSave | None = None  # this rank's file of the checkpoint being written
        self.previous = None  # the shard a reshape replaced, until the switch is committed or reverted
        self.snapshot_s = None  # what the last snapshot cost (packing + object store), reported with each step
        # What building the first optimizer imports (~1 s), paid here: a spare, or a rank started ahead
        # of a resize, has it behind it when it is needed.
        importlib.import_module("torch._dynamo")
        self.corpus = job_corpus(self.cfg.data)
        self.document_eod = document_eod(self.cfg.data, self.corpus)
        vocabulary_fits(self.corpus, self.cfg.data, self.cfg.model.vocab_size)
        self.store = None  # the rendezvous store this rank listens on while it is to be rank 0 of a join
        self.up = time.time()  # when this process was ready for work (reported by `where`)
        # What is here now (modules, torch, dynamo: ~300k objects) lives as long as the process: out of the
        # collector's sight, a full collection (leave_groups, on the way out of a failed step, while its peers
        # wait) takes ~1 ms instead of ~0.3 s. What comes later (process groups, shards) is still collected.
        gc.freeze()

    # -- rendezvous ------------------------------------------------------------------
    def rendezvous_address(self) -> str:
        """tcp://<this node's ip>:<port> of a store this rank (rank 0 of the next join) listens on already,
        so that no rank connects before it listens (raytp.parallel.groups.listening_store)."""
        ip = self._node_ip()
        self.store = listening_store(ip, self.cfg.runtime.collective_timeout_s)
        return f"tcp://{ip}:{self.store.port}"

    def _checked(self, layout: Layout) -> Layout:
        """The layout the driver hands over, which the job this worker runs must ask for."""
        if layout != Layout.of(self.cfg.parallel):
            raise ValueError(f"rank {self.rank} was handed layout {layout!r} for a job at "
                             f"{Layout.of(self.cfg.parallel)!r}")
        return layout

    def _stage(self):
        """This rank's pipeline stage (raytp.models.stage), None at pp == 1; its schedule is set with it."""
        p = self.cfg.parallel
        stage = stage_of(model_args(self.cfg), p.pp, self.groups.pp_rank, p.pp_virtual, p.pp_layers)
        self.pipeline = PipelineSchedule(p.pp_schedule, stage, p.sequence_parallel) if stage else None
        return stage

    def _training_modes(self) -> None:
        """What the job turns on in a new shard: activation checkpointing, the document mask."""
        self.model.activation_checkpointing = self.cfg.train.activation_checkpointing
        self.model.document_eod = self.document_eod

    def _join(self, layout: Layout, rank: int, init_method: str):
        """Meet the world of `layout` at `init_method` as `rank`; its TP and DP groups."""
        self.calls.reset()
        try:
            return init_process_groups(layout, rank, init_method, self.cfg.runtime.device,
                                       self.cfg.runtime.collective_timeout_s)
        finally:
            self.store = None  # rank 0's world holds the store's server now (or the join failed)

    def assume(self, rank: int, job: dict) -> None:
        """A warm spare takes rank `rank` of the job as it now is (its groups and shard come next)."""
        self.rank, self.cfg = rank, from_dict(job)
        self._announce()

    def setup(self, layout: Layout, init_method: str, source=None) -> dict:
        """Join the process groups and build this rank's shard: from the seeded initialisation (only its
        own slices are computed), or, given a source (raytp.files.state_sources: a checkpoint, a Hugging Face
        directory; or a one-device state), from its slices of it, with no initialisation at all."""
        t0 = time.perf_counter()
        self.groups = self._join(self._checked(layout), self.rank, init_method)
        if source is None:
            self.model = build_shard(model_args(self.cfg), self.cfg.train.seed, self.groups.tp,
                                     self.cfg.parallel.sequence_parallel, self.device, self._stage())
            self._training_modes()
            self.hyper = hyper(self.cfg)
            self.optimizer = make_optimizer(self.model, self.hyper, self.groups.layout.dp, self.groups.dp_rank,
                                            self.groups.layout.zero,
                                            overlap=self.cfg.parallel.overlap_grad_reduce,
                                            overlap_gather=self.cfg.parallel.overlap_param_gather)
        else:
            self._build_from(source)
        n_local = sum(p.numel() for p in self.model.parameters())
        self._announce()
        return {"rank": self.rank, "params_local": n_local, "setup_s": time.perf_counter() - t0}

    def reshape(self, layout: Layout, init_method: str, job: dict, rank: int, source) -> dict:
        """A TP resize that keeps this process: leave the old groups, join those of `layout` as
        `rank` (with the job as it now is), and rebuild the shard at the new TP degree from its slices of
        `source`, without the seeded initialisation."""
        t0 = time.perf_counter()
        self._settle()
        # The old shard is kept until the switch is committed (commit_reshape) or undone (revert).
        self.previous = (self.cfg, self.rank, self.model, self.optimizer, self.hyper, self.groups.layout)
        own = (self.model, self.optimizer, self.groups.tp_rank, self.groups.layout.tp)
        self.cfg, self.rank = from_dict(job), rank
        # No gc.collect as in leave_groups: no peer is blocked on this rank's sockets.
        destroy_process_groups()
        self.groups = None
        self.groups = self._join(self._checked(layout), rank, init_method)
        self._build_from(source, own)
        self._announce()
        return {"rank": self.rank, "reshape_s": time.perf_counter() - t0}

    # -- training ------------------------------------------------------------------
    def _micro_batches(self, split: str, step: int) -> list:
        cfg, g = self.cfg, self.groups
        x, y = batch(self.corpus, split, cfg.train.seed, step, g.dp_rank, g.layout.dp,
                     cfg.train.batch_size, cfg.model.block_size)
        check_ids(x, y, cfg.model.vocab_size, split, step)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        n = cfg.micro_batch
        return list(zip(x.split(n), y.split(n)))

    def _step(self, step: int, before_update=None) -> dict:
        comm.STATS.take()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        micro_batches = self._micro_batches("train", step)
        data_s = time.perf_counter() - t0
        r = train_step(self.model, self.optimizer, micro_batches, self.groups, step, self.hyper, before_update,
                       self.pipeline)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed, comm_s = time.perf_counter() - t0, comm.STATS.take()[0]
        self.completed = step + 1
        ranks = comm.all_gather_float(elapsed - comm_s, self.device)  # each rank's compute: who holds back whom
        return {"step": step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "step_time_s": elapsed,
                "comm_s": comm_s, "snapshot_s": self.snapshot_s, "data_s": data_s, "rank_compute_s": ranks,
                "epoch": epochs_read(self.corpus, (step + 1) * self.cfg.train.batch_size, self.cfg.model.block_size),
                "peak_tflops": self.peak_tflops, **peak_memory(self.device)}

    def train(self, start: int, count: int) -> list[dict]:
        """Run optimizer steps start .. start+count-1; returns one record per step."""
        return [self._step(step) for step in range(start, start + count)]

    def run_steps(self, start: int, count: int, snapshot_every: int, seq: int, after: int | None = None,
                  report: bool = True, relay: list | None = None):
        """Like `train`, streamed (call with num_returns="streaming"): yields each step's record as
        it completes (only on a reporting rank, `report`; the driver reads the others' ends and
        errors) and, every `snapshot_every` steps on the ranks that own the state, this rank's
        state right after it, followed by that step's record whether it reports or not (so a record
        read means the snapshot part before it is whole, not the error of a rank that died in
        between). Yielded objects are owned by the caller (the driver), so a snapshot outlives this
        worker.

        Calls run one at a time, in the driver's order (raytp.runtime.worker.calls): `seq` numbers
        this call; `after` is the call it was submitted behind, while that one ran. It starts the
        moment that call's steps end here, or fails at once, without a step, if that call failed or
        this rank's process groups were torn down or rebuilt since.

        A snapshot stalls nothing: steps run on a training thread of their own, while this
        generator's thread packs the state into a reused host buffer and writes it to the object
        store (the yield). The next step only reads the weights and optimizer state until its
        optimizer update, and that update waits until the packing is done; so the copy overlaps the
        next forward and backward passes.

        If a collective fails (a peer died, or left one), this rank destroys its process groups,
        which closes its sockets so that peers blocked on it fail too, and raises WorkerAborted.

        `relay`: the handles of other ranks of this node this rank hands the call to (it leads them,
        raytp.runtime.cluster.relay); its call ends once theirs have, with the first error of theirs.
        """
        peers = relay_calls.forward(relay, (start, count, snapshot_every, seq, after)) if relay else []
        own = self._own_steps(start, count, snapshot_every, seq, after, report)
        try:
            yield from own
        except BaseException:
            relay_calls.collect(peers, raising=False)  # their errors follow from this one: read, not raised
            raise
        relay_calls.collect(peers)

    def _own_steps(self, start: int, count: int, snapshot_every: int, seq: int, after: int | None, report: bool):
        """This rank's part of run_steps (a generator of what it yields)."""
        self.calls.begin(seq, start, after)
        if after is None:  # else the call before ended well, and left the buffers to its last yield
            self.snap_bufs.reset()

        def loop(put) -> None:
            failure, last = None, None  # last: the buffer of the newest snapshot, maybe still packing
            try:
                for step in range(start, start + count):
                    try:
                        rec = self._profiled_step(step, before_update=lambda last=last: self._settle(last))
                    except Exception as e:  # noqa: BLE001 - every failure mid-step leaves the groups
                        failure = f"rank {self.rank} left step {step}: {type(e).__name__}: {e}"
                        break
                    snapshot = snapshot_every and (step + 1) % snapshot_every == 0 and self.groups.owns_state
                    if snapshot:
                        state = live_state(self.model, self.optimizer)
                        last = self.snap_bufs.take(state_bytes(state))
                        put((step + 1, last, state))  # before the record: a record read proves its part
                    if report or snapshot:
                        put(rec)
                if last is not None:
                    last.packed.wait()  # the state is the snapshot's until it is copied
            except BaseException as e:  # noqa: BLE001 - reported through the stream, never lost
                failure = f"rank {self.rank} failed: {type(e).__name__}: {e}"
            if failure:  # outside the except block, so the failed step's frames are gone
                self.leave_groups()
            self.calls.end(seq, None if failure else start + count)  # a call queued behind starts now
            if failure:
                raise WorkerAborted(failure)

        for item in on_thread(loop, f"raytp-rank{self.rank}-steps"):
            if isinstance(item, tuple):  # (step after, buffer, live state) of a snapshot
                at_step, buf, state = item
                t0 = time.perf_counter()
                try:
                    packed = self.snap_bufs.pack(state, buf)
                finally:
                    buf.packed.set()
                del state
                self.snap_bufs.newest = (at_step, packed, buf)
                yield packed
                self.snapshot_s = time.perf_counter() - t0  # packing and the write to the object store
                buf.free.set()  # written to the object store: the buffer may be packed again
            else:
                yield item

    def ping(self) -> int:
        return self.rank

    def status(self) -> dict:
        """Answered even while a step runs (the actor is threaded): completed steps, and whether a call runs
        (or one queued behind it is about to)."""
        return {"rank": self.rank, "completed": self.completed, "running": self.calls.busy()}

    def leave_groups(self) -> None:
        """Destroy this rank's process groups and drop every reference to them, so that their
        sockets close now: peers blocked on this rank then fail too (gloo has no abort that
        unblocks a collective; a closed socket does); no call queued behind the one that ran may start
        now. Idempotent."""
        self.calls.reset()
        if self.optimizer is not None:
            self.optimizer.abandon()  # its collectives in flight hold their groups (and sockets) open
        destroy_process_groups()
        if self.model is not None:
            rebind_groups(self.model, None)
        self.groups = None
        gc.collect()

    def rejoin(self, layout: Layout, init_method: str, job: dict | None = None, rank: int | None = None) -> None:
        """Build new process groups (after a failure or a DP resize) and rebind the model's layers to
        them; keeps the state. `job`: the job as it is now (a resize changes its layout and micro-batch);
        `rank`: a new rank (an elastic shrink renumbers replicas; the TP rank never changes)."""
        if job is not None:
            self.cfg = from_dict(job)
        if rank is not None:
            self.rank = rank
        destroy_process_groups()
        self.groups = self._join(self._checked(layout), self.rank, init_method)
        rebind_groups(self.model, self.groups)
        self._announce()

    def shutdown(self) -> None:
        destroy_process_groups()
