"""The Driver: a state machine that decides, and carries out through one WorkerGroup.

It runs in the process of ``raytp train`` with an embedded Ray, or in the run's coordinator actor when the run joins
a cluster (raytp.runtime.coordinator): SCHEDULING (reserve the placement, start the actors, meet in
torch.distributed) -> RUNNING (streamed calls of ``steps_per_call`` steps, evaluation, checkpoints) <-> RECOVERING
or RESIZING -> FINISHED, or FAILED / STOPPED. Recoveries, resizes and moves hand the next worker group to
``changes`` (raytp.runtime.driver.group_changes), the one place the job switches to it, so its layout, config,
placement and workers always agree. Whatever happens, ``release`` kills the actors and removes the placement
groups, and the run directory keeps every line written so far.

The Ray-facing parts are class attributes a test may swap: ``worker_cls`` (what each rank runs: faults are injected
through it), ``group_cls`` (how workers are placed, started and called: a fake runs the loop without Ray),
``control_cls`` and ``copy_cls`` (the control actor, the off-node snapshot copy). The collaborators each own their
part and hand back what changed: GroupChanges, Checkpoints, the snapshots' copy, Spares, Profiles, the control
channel (requests arrive typed: raytp.runtime.driver.run_status).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from raytp.config import JobConfig
from raytp.parallel.layout import Layout
from raytp.runtime import policy
from raytp.runtime.driver import follow_on, reporting, run_status
from raytp.runtime.driver.control_actor import ControlChannel
from raytp.runtime.driver.group_changes import GroupChanges
from raytp.runtime.errors import FAILURES
from raytp.runtime.cluster.group import WorkerGroup
from raytp.runtime.driver.metrics import RunLog
from raytp.runtime.driver.profiles import Profiles
from raytp.runtime.driver.progress import Progress
from raytp.runtime.records import Outcome, State
from raytp.runtime.state.checkpoints import Checkpoints
from raytp.runtime.state.snapshots import Cadence, OffNodeCopy
from raytp.runtime.recovery.spares import Spares
from raytp.runtime.worker.worker import Worker
from raytp.files.checkpoint import CheckpointError
from raytp.files import checkpoint_owner
from raytp.files.storage import checkpoint_location


class Driver:
    worker_cls = Worker
    group_cls = WorkerGroup
    control_cls = ControlChannel
    copy_cls = OffNodeCopy

    def __init__(self, cfg: JobConfig, run_dir: Path, run: str, out=sys.stderr, ray_metrics: bool = True,
                 init_state: tuple[int, dict, str] | None = None, memory=None):
        """`init_state`: (step, source, where from) to start from instead of the seeded initialisation:
        a raytp.files.state_sources source (a checkpoint, a Hugging Face model) that every worker reads its
        own slices of. `memory`: the start line's estimate of a worker (raytp.runtime.estimate.WorkerMemory;
        worked out from `cfg` if None), which the first step's measured peak is compared with."""
        self.job, self.run_dir, self.run = cfg, Path(run_dir), run
        self.memory = memory
        self.init_state = init_state
        self.log = RunLog.for_job(cfg, self.run_dir, run, ray_metrics, init_state[0] if init_state else 0)
        self.out = self.log.tee(out)  # also kept in the run dir's driver.log
        self.state = State.SCHEDULING
        self.controls = run_status.RunControl(None)  # the control actor's channel, the stop asked for
        self.step = 0
        self.last: dict = {}
        self.owed: tuple | None = None  # (metrics line, ranks' compute) of a step whose evaluation failed
        self.first_step: float | None = None  # seconds from the command to the first completed step
        self.cadence = Cadence(cfg)  # how often replica 0 snapshots
        self.copy = self.copy_cls(run, self.log)
        self.spares = Spares(run, cfg.recovery.spares, self.log)
        self.run_id = checkpoint_owner.read_run_id(self.run_dir) or checkpoint_owner.new_run_id()
        checkpoint_owner.keep_run_id(self.run_dir, self.run_id)  # the run's mark on what it writes
        self.checkpoints = Checkpoints(checkpoint_location(cfg, self.run_dir, run), cfg.checkpoint.keep,
                                       self.log, self.run_id)
        self.profiles = Profiles(cfg.profile, self.checkpoints.storage, self.log, self._say)  # profile, raytp profile
        self.t_start = time.perf_counter()
        self.calls = follow_on.Calls()  # the streamed call in flight and the one submitted behind it
        self.changes = GroupChanges(cfg, run, self.log, self._say, spares=self.spares, copy=self.copy,
                                    checkpoints=self.checkpoints, cadence=self.cadence, calls=self.calls,
                                    show=self._show, answer=lambda rid, outcome: self.controls.answer(rid, outcome))

    # -- the group and what follows from it (raytp.runtime.driver.group_changes) ----------------
    @property
    def group(self) -> WorkerGroup | None:
        return self.changes.group

    @property
    def failures(self) -> int:
        return self.changes.failures

    @property
    def cfg(self) -> JobConfig:
        return self.group.cfg if self.group is not None else self.job

    @property
    def layout(self) -> Layout:
        return self.cfg.layout

    def view(self) -> dict:
        """What the control side publishes of the run (raytp.runtime.driver.run_status.summary)."""
        return {"state": self.state, "step": self.step, "steps": self.cfg.train.steps, "layout": self.layout,
                "last": self.last, "failures": self.failures, "spares": len(self.spares.pool),
                "run_dir": str(self.run_dir.resolve()), "placement": self.group.placement if self.group else ()}

    # -- lifecycle -------------------------------------------------------------------------------
    def run_to_end(self, t_start: float | None = None) -> dict:
        """Train to cfg.train.steps; returns the summary. Releases all resources on any exit.
        `t_start` (perf_counter) is when the user asked, for the time-to-first-step figure."""
        t_start = self.t_start = time.perf_counter() if t_start is None else t_start
        try:
            self.start()
            self.train_loop(t_start)
            summary = {"steps": self.step, "loss": self.last.get("loss"), "val_loss": self.last.get("val_loss"),
                       "seconds": time.perf_counter() - t_start, "failures": self.failures}
            if self.controls.stop is None:
                self.state = State.FINISHED
                self.log.event("finished", **summary)
            self.publish()
            return {**summary, "state": self.state.value}
        except KeyboardInterrupt:
            self.state = State.STOPPED
            self.log.event("stopped", step=self.step, reason="interrupted")
            raise
        except BaseException as e:
            self.state = State.FAILED
            self.log.event("failed", step=self.step, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            self.release()
            self.log.close()

    def start(self) -> None:
        cfg = self.job
        self.controls = run_status.RunControl(self.control_cls(self.run, self._say) if self.control_cls else None)
        self.publish()
        reporting.started(self.log, self._say, self.run, cfg)
        launcher = self.group_cls.launcher_cls(self.run, self.worker_cls, evict=self.spares.evict,
                                                  say=self._say)
        # With a state to start from, every worker builds its shard from its slices of it: no seeded init.
        self.changes.adopt(self.group_cls.launch(launcher, cfg, self.init_state[1] if self.init_state else None))
        reporting.placed(self._say, cfg, self.group.placement)
        self.checkpoints.check_reached(self.group)
        if self.cadence.every:
            self.copy.update(self.group, self.changes.snapshots, self.step)  # its keeper starts while the first step runs
        self.changes.survival()
        self.spares.start(self.group)  # in the background, like the keeper
        if self.init_state is not None:
            step, _, source = self.init_state
            self.step = self.log.next_step = self.checkpoints.committed = step  # that state is saved already
            reporting.resumed(self.log, self._say, step, source)
            self.init_state = None  # free the driver's copy
        self.profiles.start(self.group, self.step)
        self.state = State.RUNNING

    def save_checkpoint(self) -> str:
        """Save the step reached and wait for it (in the loop, saves are begun and committed later)."""
        return self.checkpoints.save_now(self.group, self.step)

    # -- training --------------------------------------------------------------------------------
    def train_loop(self, t_start: float | None = None, until: int | None = None) -> None:
        """Train from self.step to `until` (default: the job's last step), healing failures on the way."""
        t_start = time.perf_counter() if t_start is None else t_start
        steps = self.cfg.train.steps
        end, progress = (steps if until is None else min(until, steps)), Progress(steps, self.out)
        try:
            while self.step < end or (self.step == steps and policy.checkpoint_due(
                    steps, steps, self.cfg.checkpoint.every, self.checkpoints.last_step)):
                self.checkpoints.poll(self.group)
                if self.calls.next is None:  # else the next call runs already: this waits for its end
                    self.handle_requests()
                    self.step = self.changes.boundary(self.step)
                self.spares.refill(self.group)
                if self.controls.stop is not None and self.calls.next is None:
                    self.stop()
                    return
                try:
                    self._write_owed()
                    if self.step < end:
                        self._call(end, t_start, progress)
                    else:  # the last step's checkpoint, cut short by a failure: saved after recovery
                        self.checkpoints.begin(self.group, self.step)
                    if self.step == steps:
                        self.checkpoints.finish(self.group)  # the run's last checkpoint is whole when it ends
                        self.changes.closed(self.step, self.last)
                except FAILURES + (CheckpointError,) as e:
                    self.step = self.changes.recover(e, self.step)
                self.profiles.poll(self.step, self.controls.answer)  # every rank's calls before this step have ended
                self.publish()
        finally:
            self.calls.forget_next()
            progress.close()

    def _call(self, end: int, t_start: float, progress: Progress) -> None:
        """One streamed call of up to steps_per_call steps, then evaluation and checkpoint if due."""
        cfg = self.cfg
        steps, save_every = cfg.train.steps, cfg.checkpoint.every
        self.cadence.follow(cfg)
        if self.calls.next is None:
            warm = self.first_step is not None and self.pending_resize is None
            n = policy.call_length(self.step, end, cfg.train.steps_per_call, warm, cfg.train.eval_interval, save_every)
            if policy.checkpoint_due(self.step, steps, save_every, self.checkpoints.last_step):
                self.checkpoints.begin(self.group, self.step)  # a save interrupted by a failure, redone now
        else:
            n = 0  # the call behind the last one
        stream = self.calls.begin(self.group, self.step, n, self.cadence.every)
        stream.excuse(self.profiles.tracing(stream.start, stream.start + stream.count - 1))
        snap = stream.snap
        if stream.count == 1:
            self._submit_next(end)
        for done in stream:
            if self.step == stream.start and stream.count > 1:
                self._submit_next(end)  # once the call runs: its ranks are not slowed while it starts
            for part, ref in done.snapshot.items():
                self.changes.snapshots.add(done.step + 1, part, ref)
            self.step = done.step + 1
            self.last = reporting.step_record(done.records[0], done.records, self.cfg, self.layout)
            self.cadence.observe(done.records[0])
            self.owed = (self.last, done.records[0].get("rank_compute_s"))
            self._write_owed()
            self.changes.respread.wants_boundary(self.group)  # a move off a twin's node, taken a stage further
            if snap:
                self.copy.update(self.group, self.changes.snapshots, self.step)
            self.changes.closed(self.step, self.last)
        if policy.checkpoint_due(self.step, steps, save_every, self.checkpoints.last_step):
            self.checkpoints.begin(self.group, self.step)  # written while the next steps run
        changed = self.cadence.choose(cfg, self.layout, self.group.nodes())
        if changed is not None:
            reporting.interval_chosen(self.log, self.cadence, changed, self.step, self.last)
        if self.first_step is None:
            self.first_step = time.perf_counter() - t_start
            reporting.first_step(self.log, self._say, self.cfg, self.last, self.first_step, self.memory)
        progress.update(self.last, time.perf_counter() - t_start)

    def _write_owed(self) -> None:
        """Write the metrics line of the step just completed, evaluated first where due; a failed evaluation keeps
        it owed: written after the recovery if training goes on from the step after it, else by the replay."""
        rec, ranks = self.owed or ({"step": -2}, None)
        if rec["step"] + 1 == self.step:  # else none is owed, or the replay writes it
            if policy.evaluation_due(self.step, self.cfg.train.steps, self.cfg.train.eval_interval):
                rec["val_loss"] = self.group.evaluate(self.step)
            self.log.metric(rec, ranks)
        self.owed = None

    def _submit_next(self, end: int) -> None:
        """Submit the next call behind the one in flight if nothing must happen between them."""
        quiet = self.controls.stop is None and not self.controls.waiting() and self.changes.quiet()
        self.calls.submit_next(self.cfg, end, self.checkpoints.last_step, quiet, self.cadence.every)

    def _show(self, state: State) -> None:
        self.state = state
        self.publish()

    # -- control requests (raytp stop / scale / profile), served at step boundaries -----------------
    @property
    def control(self):
        """The channel to the run's control actor (raytp.runtime.driver.control_actor), None without one."""
        return self.controls.channel

    def publish(self) -> None:
        self.controls.publish(self.view(), time.perf_counter() - self.t_start)

    def request_stop(self, request_id: int | None = None, via: str = "control") -> None:
        self.controls.ask_stop(request_id, via)

    def handle_requests(self) -> None:
        """Serve the requests filed through the control actor at this step boundary (a stop is served by
        the loop, at the boundary, with a checkpoint)."""
        def profile(req: run_status.ProfileAsked) -> Outcome:
            return self.profiles.request(self.group, self.step, self.cfg.train.steps, req)
        if self.controls.serve(self.layout, self.request_resize, profile):
            self.publish()

    def stop(self) -> None:
        """Stop at this step boundary on request: a resize under way dropped, a checkpoint of the step reached."""
        self.controls.answer(*(self.changes.elastic.cancel(self.group, "the run was stopped") or (None, None)))
        self.handle_requests()  # a stop filed meanwhile (`raytp stop` sends SIGTERM too) is answered as well
        path = self.save_checkpoint() if self.step > 0 else None
        self.state = State.STOPPED
        self.log.event("stopped", step=self.step, reason="requested", via=self.controls.stop.via,
                       checkpoint=str(path) if path else None)
        for rid in self.controls.stop.ids:
            self.controls.answer(rid, Outcome(ok=True, step=self.step, checkpoint=str(path) if path else None))
        self._say(f"stopped at step {self.step} on request" + (f"; checkpoint {path}" if path else ""))

    # -- resizes (carried out by GroupChanges) ------------------------------------------------
    @property
    def pending_resize(self):
        return self.changes.elastic.pending

    def resize(self, **degrees: int | None) -> Outcome:
        """Move to the layout with these degrees (raytp.parallel.layout.SCALED, by name; None: kept) now
        (GroupChanges.resize_now; tests, benchmarks)."""
        return self.changes.resize_now(self.step, self.cfg.runtime.placement_timeout_s, **degrees)

    def request_resize(self, target: Layout, request_id: int | None = None) -> Outcome | None:
        return self.changes.request(target, self.step, request_id)

    def advance_resize(self, now: bool = False) -> Outcome | None:
        return self.changes.advance(self.step, now)

    def logits(self, idx):
        """Full-vocabulary logits of a batch from replica 0 (for checks and tests)."""
        return self.group.logits(idx)

    def release(self) -> None:
        """Kill the actors and remove the placement groups (idempotent)."""
        if self.group is not None:
            self.group.release()
            self.changes.release()
        self.copy.release()
        self.spares.release()
        self.controls.close()

    def say(self, msg: str) -> None:
        """A `[raytp]` line of the run's output (its stream and driver.log)."""
        print(f"[raytp] {msg}", file=self.out, flush=True)

    _say = say  # handed to the collaborators as their `say`
