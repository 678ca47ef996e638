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
import time

from raytp.config import from_dict
from raytp.config.adapters import model_args
from raytp.parallel import group_sockets
from raytp.parallel.groups import connect_store, destroy_process_groups, init_process_groups, listening_store
from raytp.parallel.layout import Layout
from raytp.moves.owners import Owners
from raytp.models.shard import rebind_groups
from raytp.models.stage import stage_of
from raytp.runtime.cluster import relay as relay_calls
from raytp.runtime.worker import identity, process, rank_compute
from raytp.runtime.worker.streamed_calls import StreamedCalls
from raytp.runtime.errors import WorkerAborted
from raytp.runtime.worker.held_shard import HeldShard
from raytp.runtime.worker.profiling import ProfilePlan, StepProfiler
from raytp.files.storage import Storage, answer_probe
from raytp.train.shard_state import live_state
from raytp.data.corpus import document_eod, job_corpus, vocabulary_fits
from raytp.train.stage_runner import PipelineSchedule


class Worker:
    def __init__(self, job: dict, rank: int):
        self.cfg = from_dict(job)
        self.rank = rank
        self.device, self.peak_tflops = process.prepare(self.cfg)
        self.groups = None  # raytp.parallel.groups.ProcessGroups, once it joined
        self.shard: HeldShard | None = None  # its weights and AdamW state
        self.pipeline = None  # raytp.train.stage_runner.PipelineSchedule of this rank's stage, at pp > 1
        self.completed = 0
        self.torn = False  # a step failed mid-update: the state is neither `completed`'s nor the next step's
        self.steps = StreamedCalls(self.device)  # its streamed calls: their order, snapshot buffers, last records
        self.profiler = StepProfiler()  # traces of the steps a ProfilePlan names
        self.previous = None  # (job, rank, shard, layout) a reshape replaced, until committed or reverted
        self.corpus = job_corpus(self.cfg.data)
        self.document_eod = document_eod(self.cfg.data, self.corpus)
        vocabulary_fits(self.corpus, self.cfg.data, self.cfg.model.vocab_size)
        self.store = None  # the rendezvous store this rank listens on while it is to be rank 0 of a join
        self.joining = None  # while it joins: the sockets it had before (raytp.parallel.group_sockets)
        self.join_aborted = False
        self.up = time.time()  # when this process was ready for work (reported by `where`)
        # What is here now (modules, torch, dynamo: ~300k objects) lives as long as the process: out of the
        # collector's sight, a full collection (leave_groups, on the way out of a failed step, while its peers
        # wait) takes ~1 ms instead of ~0.3 s. What comes later (process groups, shards) is still collected.
        gc.freeze()

    # -- rendezvous ------------------------------------------------------------------
    def rendezvous_address(self) -> str:
        """tcp://<this node's ip>:<port> of a store this rank (rank 0 of the next join) listens on already,
        so that no rank connects before it listens (raytp.parallel.groups.listening_store)."""
        ip = identity.node_ip()
        self.store = listening_store(ip, self.cfg.runtime.collective_timeout_s)
        return f"tcp://{ip}:{self.store.port}"

    def _checked(self, layout: Layout) -> Layout:
        """The layout the driver hands over, which the job this worker runs must ask for."""
        if layout != self.cfg.layout:
            raise ValueError(f"rank {self.rank} was handed layout {layout!r} for a job at {self.cfg.layout!r}")
        return layout

    def _stage(self):
        """This rank's pipeline stage (raytp.models.stage), None at pp == 1; its schedule is set with it."""
        p = self.cfg.parallel
        stage = stage_of(model_args(self.cfg), p.pp, self.groups.pp_rank, p.pp_virtual, p.pp_layers)
        self.pipeline = PipelineSchedule(p.pp_schedule, stage, p.sequence_parallel) if stage else None
        return stage

    def _build(self, source=None, own=None) -> None:
        """A new shard at this rank's place in its groups (raytp.runtime.worker.held_shard.HeldShard.build):
        seeded, or holding its slices of `source`; the one it replaces is let go first."""
        old, self.shard = self.shard, None
        if old is not None:
            old.settle()
        modes = {"activation_checkpointing": self.cfg.train.activation_checkpointing,
                 "document_eod": self.document_eod}
        self.shard = HeldShard.build(self.cfg, self.groups, self.device, self._stage(), modes, source, own)
        self.torn = False
        if old is not None:
            self.shard.saving = old.saving  # a checkpoint file still being written goes on being written

    def _join(self, layout: Layout, rank: int, init_method: str):
        """Meet the world of `layout` at `init_method` as `rank`; its TP and DP groups."""
        self.steps.calls.reset()
        self.joining, self.join_aborted = group_sockets.open_sockets(), False  # what an abort leaves alone
        timeout_s = self.cfg.runtime.collective_timeout_s
        try:
            # At tcp:// each rank (rank 0 too, at its own server) meets through a client an abort can end;
            # other ways of meeting (file://, outside Ray) are torch's own.
            tcp = init_method.startswith("tcp://")
            store = connect_store(init_method, timeout_s, lambda: self.join_aborted, rank == 0) if tcp else None
            return init_process_groups(layout, rank, init_method, self.cfg.runtime.device, timeout_s, store)
        finally:
            self.store = None  # rank 0's world holds the store's server now (or the join failed)
            self.joining = None

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
        self._build(source)
        n_local = sum(p.numel() for p in self.shard.model.parameters())
        self._announce()
        return {"rank": self.rank, "params_local": n_local, "setup_s": time.perf_counter() - t0}

    def reshape(self, layout: Layout, init_method: str, job: dict, rank: int, source) -> dict:
        """A TP resize that keeps this process: leave the old groups, join those of `layout` as
        `rank` (with the job as it now is), and rebuild the shard at the new TP degree from its slices of
        `source`, without the seeded initialisation."""
        t0 = time.perf_counter()
        self.shard.settle()
        # The old shard is kept until the switch is committed (commit_reshape) or undone (revert).
        self.previous = (self.cfg, self.rank, self.shard, self.groups.layout)
        own = (self.shard.model, self.shard.optimizer, self.groups.tp_rank, self.groups.layout.tp)
        self.cfg, self.rank = from_dict(job), rank
        # No gc.collect as in leave_groups: no peer is blocked on this rank's sockets.
        destroy_process_groups()
        self.groups = None
        self.groups = self._join(self._checked(layout), rank, init_method)
        self._build(source, own)  # the old shard stays in self.previous
        self._announce()
        return {"rank": self.rank, "reshape_s": time.perf_counter() - t0}

    # -- training ------------------------------------------------------------------
    def _micro_batches(self, split: str, step: int) -> list:
        return rank_compute.micro_batches(self.cfg, self.corpus, self.groups, self.device, split, step,
                                          self.document_eod)

    def _step(self, step: int, before_update=None) -> dict:
        def updating() -> None:
            if before_update is not None:
                before_update()
            self.torn = True  # until the step ends: zero 1's gather of the new weights may still fail
        record = rank_compute.train_record(self.cfg, self.corpus, self.shard, self.groups, self.pipeline, self.device,
                                           step, updating, self._micro_batches)
        self.completed, self.torn = step + 1, False
        record = {**record, "snapshot_s": self.steps.snapshot_s, "peak_tflops": self.peak_tflops}
        self.steps.keep(step, record, self.cfg.train.steps_per_call)  # recovery reads them back (kept_records)
        return record

    def kept_records(self, start: int, stop: int) -> list[dict]:
        return self.steps.kept_records(start, stop)

    def run_steps(self, start: int, count: int, snapshot_every: int, seq: int, after: int | None = None,
                  report: bool = True, relay: list | None = None):
        """Steps start .. start+count-1, streamed (call with num_returns="streaming"): each step's record
        and, every `snapshot_every` steps on the ranks that own the state, that state (what it yields, in
        which order, on which threads: raytp.runtime.worker.streamed_calls). `relay`: the handles of other
        ranks of this node this rank hands the call to (it leads them, raytp.runtime.cluster.relay); its
        call ends once theirs have, with the first error of theirs."""
        peers = relay_calls.forward(relay, (start, count, snapshot_every, seq, after)) if relay else []
        own = self.steps.run(self.rank, start, count, snapshot_every, seq, after, report,
                             self._traced_step, self._snapshot_state, self.leave_groups)
        try:
            yield from own
        except BaseException:
            relay_calls.collect(peers, raising=False)  # their errors follow from this one: read, not raised
            raise
        relay_calls.collect(peers)

    def _traced_step(self, step: int, last) -> dict:
        """One step, traced where a profile plan covers it; its optimizer update waits for the snapshot
        `last` to be packed."""
        return self.profiler.run(step, self.rank, self.device,
                                 lambda: self._step(step, before_update=lambda: self.shard.settle(last)))

    def _snapshot_state(self):
        """The live state to snapshot, on a rank that owns the state (raytp.moves.owners); else None."""
        return live_state(self.shard.model, self.shard.optimizer) if Owners(self.groups.layout).owns(self.groups.rank) else None

    def ping(self) -> int:
        return self.rank

    def abort_collectives(self) -> int:
        """Fail, now, a collective of this rank's blocked on a peer that will never answer (a frozen or vanished
        host's, whose sockets stay open): the step then fails as on any peer's loss (ProcessGroups.abort); or a
        join held by a rank that will not come (lost while the ranks meet): it fails, the state stays."""
        joining = self.joining
        if joining is not None:
            self.join_aborted = True  # a connection to a lost rendezvous host is tried no more
            return group_sockets.shut_opened_since(joining)
        return self.groups.abort() if self.groups is not None else 0

    def thread_stacks(self) -> dict[str, str]:
        return process.thread_stacks()  # asked of a rank still inside a failed step after its abort (leaving.wait_out)

    def end_process(self, pid: int, up: float | None = None) -> bool:
        return identity.end_process(pid, up)  # a hung rank beside this one (raytp.runtime.cluster.health)

    def look_at(self, pid: int, over_s: float, up: float | None = None) -> str:
        return identity.look_at(pid, over_s, up)  # a silent rank beside this one: stopped, or busy?

    def status(self) -> dict:
        """Answered even while a step runs (threaded actor): completed steps, whether a call runs (or one
        queued behind it is about to, or it joins), whether the state is torn (a step failed mid-update), and the
        CPU seconds its process has used (raytp.runtime.leaving: blocked, or computing?)."""
        return {"rank": self.rank, "completed": self.completed, "torn": self.torn,
                "running": self.steps.calls.busy() or self.joining is not None, "cpu_s": time.process_time()}

    def leave_groups(self) -> None:
        """Destroy this rank's process groups and drop every reference to them, so that their
        sockets close now: peers blocked on this rank then fail too (gloo has no abort that
        unblocks a collective; a closed socket does); no call queued behind the one that ran may start
        now. Idempotent."""
        self.steps.calls.reset()
        if self.shard is not None and self.shard.optimizer.abandon():  # in flight, they hold their sockets open
            self.torn = True  # a gather of new weights was among them
        destroy_process_groups()
        if self.shard is not None:
            rebind_groups(self.shard.model, None)
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
        rebind_groups(self.shard.model, self.groups)
        self._announce()

    # -- its state in and out (raytp.runtime.worker.held_shard) ---------------------------------
    def export_moves(self, moves: list):
        """HeldShard.export_moves; call with num_returns = its destinations + 1."""
        return self.shard.export_moves(moves)

    def take_moves(self, source, completed: int) -> None:
        """HeldShard.take_moves (a plan's blocks into the shard it holds), as the state after `completed`
        steps."""
        self.shard.take_moves(self.groups, source)
        self.completed, self.torn = completed, False

    def commit_reshape(self) -> None:
        """The switch took: the old shard kept by `reshape` (or the rows by `take_moves`) goes."""
        self.previous = None
        self.shard.commit()
        gc.collect()

    def revert(self) -> None:
        """The switch failed: take back the shard `reshape` kept, or the rows `take_moves` cut anew (its
        process groups come with a rejoin)."""
        self.shard.revert()
        if self.previous is not None:
            destroy_process_groups()
            self.cfg, self.rank, self.shard, _ = self.previous
            rebind_groups(self.shard.model, None)
            self.groups, self.previous = None, None

    def get_state(self) -> dict:
        return self.shard.get_state()

    def load(self, source, completed: int) -> None:
        """Take this rank's slices of `source` as the state after `completed` steps."""
        self.shard.load(self.groups, source)
        self.completed, self.torn = completed, False

    def begin_save(self, url: str, directory: str) -> dict | None:
        return self.shard.begin_save(self.groups, self.cfg, self.steps.snap_bufs, self.completed, url, directory)

    def save_result(self) -> dict:
        """{"file", "bytes"} of the save begun last, once written (raises if the write failed)."""
        return self.shard.saving.wait()

    def probe_storage(self, url: str, token: str) -> str | None:
        """Whether this process reaches the checkpoint location as the driver does (None: it does)."""
        return answer_probe(Storage(url), token, self.rank)

    # -- besides training --------------------------------------------------------------------
    def evaluate(self, step: int) -> float:
        try:
            return rank_compute.validation_loss(self.cfg, self.shard, self.groups, self.pipeline, step,
                                                self._micro_batches)
        except Exception as e:  # noqa: BLE001 - as in run_steps: leave, so that peers get out too
            failure = f"rank {self.rank} left evaluation: {type(e).__name__}: {e}"
        self.leave_groups()
        raise WorkerAborted(failure)

    def logits(self, idx):
        return rank_compute.logits(self.shard.model, idx, self.device, self.groups, self.pipeline, self.shard.hyper,
                               self.cfg.model.vocab_size)

    def profile(self, plan: ProfilePlan) -> None:
        """Trace the steps of `plan` on this rank (answered while steps run: from its next step)."""
        self.profiler.add(plan)

    def where(self) -> dict:
        return {**identity.where(self.rank, self.up), **identity.kernels(self.cfg, self.device)}

    def __repr__(self) -> str:
        return identity.role(self.rank, self.groups)

    def _announce(self) -> None:
        identity.announce(repr(self))
