"""The Driver: a state machine that decides, and carries out through one WorkerGroup.

It runs in the process of ``raytp train`` with an embedded Ray, or in the run's coordinator actor when the
run joins a cluster (raytp.runtime.coordinator): SCHEDULING (reserve the
placement, start the actors, meet in torch.distributed) -> RUNNING (streamed
calls of ``steps_per_call`` steps, evaluation, checkpoints) <-> RECOVERING (a
worker died or hung: raytp.runtime.recovery.recovery) or RESIZING (raytp.runtime.elastic.resize)
-> FINISHED, or FAILED / STOPPED. Recovery and resize build the next worker
group and hand it back; ``adopt`` is the one place the job switches to it, so
its layout, config, placement and workers always agree. Whatever happens,
``release`` kills the actors and removes the placement groups, and the run
directory keeps every line written so far.

The Ray-facing parts are class attributes a test may swap: ``worker_cls``
(what each rank runs: faults are injected through it), ``group_cls`` (how
workers are placed, started and called: a fake runs the loop without Ray),
``control_cls`` and ``copy_cls`` (the control actor, the off-node snapshot copy). Its collaborators
each own their part and hand back what changed: Elastic (the resizes: raytp.runtime.elastic.resize),
recovery (raytp.runtime.recovery.recovery), Checkpoints, Snapshots and their copy, Spares, Profiles,
the control channel (requests arrive typed: raytp.runtime.driver.run_status).
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from raytp.config import JobConfig
from raytp.parallel.layout import Layout
from raytp.parallel.ownership import Ownership
from raytp.runtime import policy
from raytp.runtime.driver import follow_on
from raytp.runtime.recovery import recovery
from raytp.runtime.recovery.respread import Respread
from raytp.runtime.driver import reporting
from raytp.runtime.state.checkpoints import Checkpoints
from raytp.runtime.driver import run_status
from raytp.runtime.driver.control_actor import ControlChannel
from raytp.runtime.elastic import resize
from raytp.runtime.elastic.resize import Elastic
from raytp.runtime.errors import FAILURES
from raytp.runtime.cluster.group import WorkerGroup
from raytp.runtime.driver.metrics import RunLog
from raytp.runtime.driver.profiles import Profiles
from raytp.runtime.driver.progress import Progress
from raytp.files.storage import checkpoint_location
from raytp.runtime.records import Outcome, State
from raytp.runtime.state.snapshots import Cadence, OffNodeCopy, Snapshots
from raytp.runtime.recovery.spares import Spares
from raytp.runtime.worker.worker import Worker
from raytp.files.checkpoint import CheckpointError


class Driver:
    worker_cls = Worker
    group_cls = WorkerGroup
    control_cls = ControlChannel
    copy_cls = OffNodeCopy

    def __init__(self, cfg: JobConfig, run_dir: Path, run: str, out=sys.stderr, ray_metrics: bool = True,
                 init_state: tuple[int, dict, str] | None = None):
        """`init_state`: (step, source, where from) to start from instead of the seeded initialisation:
        a raytp.files.state_sources source (a checkpoint, a Hugging Face model) that every worker reads its
        own slices of."""
        self.job, self.run_dir, self.run = cfg, Path(run_dir), run
        self.init_state = init_state
        self.log = RunLog.for_job(cfg, self.run_dir, run, ray_metrics, init_state[0] if init_state else 0)
        self.out = self.log.tee(out)  # also kept in the run dir's driver.log
        self.state = State.SCHEDULING
        self.group: WorkerGroup | None = None
        self.controls = run_status.RunControl(None)  # the control actor's channel, the stop asked for
        self.step = 0
        self.last: dict = {}
        self.first_step: float | None = None  # seconds from the command to the first completed step
        self.snapshots = Snapshots(Ownership(cfg.layout).parts)
        self.cadence = Cadence(cfg)  # how often replica 0 snapshots
        self.copy = self.copy_cls(run, self.log)
        self.spares = Spares(run, cfg.recovery.spares, self.log)
        self.checkpoints = Checkpoints(checkpoint_location(cfg, self.run_dir, run), cfg.checkpoint.keep,
                                       self.log)
        self.profiles = Profiles(cfg.profile, self.checkpoints.storage, self.log, self._say)  # profile, raytp profile
        self.failures = 0
        self.healing = None            # records.Healing, until the next completed step
        self.resizing = None           # records.Resizing, until the next completed step
        self.moving = None             # records.Moving, until the next completed step
        self.elastic = Elastic(cfg.parallel.max_dp or cfg.parallel.dp, self._say, self.log)
        self.t_start = time.perf_counter()
        self.calls = follow_on.Calls()  # the streamed call in flight and the one submitted behind it
        self.respread = Respread(run, self.log, self._say)  # copies moved off their twins' nodes

    # -- the group and what follows from it ----------------------------------------------------
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

    def adopt(self, group: WorkerGroup) -> None:
        """Switch the job to `group`: the one place the workers, their layout, config and placement change."""
        old = self.group
        if old is not None and group.layout != old.layout:
            self.snapshots = Snapshots(Ownership(group.layout).parts)  # snapshots of another layout are of no use
        self.group = group
        if group.placement and (old is None or group.placement != old.placement):
            self.log.event("placed", ranks=list(group.placement))

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
        cfg, lay = self.job, self.job.layout
        self.controls = run_status.RunControl(self.control_cls(self.run, self._say) if self.control_cls else None)
        self.publish()
        self.log.event("started", run=self.run, tp=lay.tp, dp=lay.dp, world_size=lay.world_size,
                       device=cfg.runtime.device, steps=cfg.train.steps)
        self._say(f"placing {lay.world_size} workers ({lay}) ...")
        launcher = self.group_cls.launcher_cls(self.run, self.worker_cls, evict=self.spares.evict,
                                                  say=self._say)
        # With a state to start from, every worker builds its shard from its slices of it: no seeded init.
        self.adopt(self.group_cls.launch(launcher, cfg, self.init_state[1] if self.init_state else None))
        if cfg.model.moe is not None and self.group.placement and "experts" in self.group.placement[0]:
            self._say(f"experts: {self.group.placement[0]['experts']} on rank 0's device")
        self.checkpoints.check_reached(self.group)
        if self.cadence.every:
            self.copy.update(self.group, self.snapshots, self.step)  # its keeper starts while the first step runs
        self._survival()
        self.spares.start(self.group)  # in the background, like the keeper
        if self.init_state is not None:
            step, _, source = self.init_state
            self.step = self.log.next_step = self.checkpoints.committed = step  # that state is saved already
            self.log.event("resumed", step=step, source=source)
            self._say(f"starting at step {step} from {source}")
            self.init_state = None  # free the driver's copy
        self.profiles.start(self.group, self.step)
        self.state = State.RUNNING

    def save_checkpoint(self) -> str:
        """Save the step reached and wait for it (in the loop, saves are begun and committed later)."""
        if self.checkpoints.last_step != self.step:
            self.checkpoints.begin(self.group, self.step)
        return self.checkpoints.finish(self.group) or self.checkpoints.newest().where

    # -- training --------------------------------------------------------------------------------
    def train_loop(self, t_start: float | None = None, until: int | None = None) -> None:
        """Train from self.step to `until` (default: the job's last step), healing failures on the way."""
        t_start = time.perf_counter() if t_start is None else t_start
        steps = self.cfg.train.steps
        end = steps if until is None else min(until, steps)
        progress = Progress(steps, self.out)
        try:
            while self.step < end or (self.step == steps and policy.checkpoint_due(
                    steps, steps, self.cfg.checkpoint.every, self.checkpoints.last_step)):
                self.checkpoints.poll(self.group)
                if self.calls.next is None:  # else the next call runs already: this waits for its end
                    self.handle_requests()
                    self.advance_resize()
                    self._take(self.elastic.grow(self.group, self.step))
                    self._moved(self.respread.advance(self.group, self.step))
                self.spares.refill(self.group)
                if self.controls.stop is not None and self.calls.next is None:
                    self.controls.answer(*(self.elastic.cancel(self.group, "the run was stopped") or (None, None)))
                    self.stop()
                    return
                try:
                    if self.step < end:
                        self._call(end, t_start, progress)
                    else:  # the last step's checkpoint, cut short by a failure: saved after recovery
                        self.checkpoints.begin(self.group, self.step)
                    if self.step == steps:
                        self.checkpoints.finish(self.group)  # the run's last checkpoint is whole when it ends
                        self._report()
                except FAILURES + (CheckpointError,) as e:
                    self._recover(e)
                self.profiles.poll(self.step, self.controls.answer)  # every rank's calls before this step have ended
                self.publish()
        finally:
            self.calls.forget_next()
            progress.close()

    def _call(self, end: int, t_start: float, progress: Progress) -> None:
        """One streamed call of up to steps_per_call steps, then evaluation and checkpoint if due."""
        cfg = self.cfg
        steps, every, save_every = cfg.train.steps, cfg.train.eval_interval, cfg.checkpoint.every
        self.cadence.follow(cfg)
        if self.calls.next is None:
            warm = self.first_step is not None and self.pending_resize is None
            n = policy.call_length(self.step, end, cfg.train.steps_per_call, warm, every, save_every)
            if policy.checkpoint_due(self.step, steps, save_every, self.checkpoints.last_step):
                self.checkpoints.begin(self.group, self.step)  # a save interrupted by a failure, redone now
        else:
            n = 0  # the call behind the last one
        stream = self.calls.begin(self.group, self.step, n, self.cadence.every)
        snap = stream.snap
        if stream.count == 1:
            self._submit_next(end)
        for done in stream:
            if self.step == stream.start and stream.count > 1:
                self._submit_next(end)  # once the call runs: its ranks are not slowed while it starts
            for tp_rank, ref in done.snapshot.items():
                self.snapshots.add(done.step + 1, tp_rank, ref)
            self.step = done.step + 1
            self.last = reporting.step_record(done.records[0], done.records, self.cfg, self.layout)
            self.cadence.observe(done.records[0])
            if self.step == steps or (every and self.step % every == 0):
                self.last["val_loss"] = self.group.evaluate(self.step)
            self.log.metric(self.last, done.records[0].get("rank_compute_s"))
            self.respread.wants_boundary(self.group)  # a move off a twin's node, taken a stage further
            if snap:
                self.copy.update(self.group, self.snapshots, self.step)
            self._report()
        if policy.checkpoint_due(self.step, steps, save_every, self.checkpoints.last_step):
            self.checkpoints.begin(self.group, self.step)  # written while the next steps run
        changed = self.cadence.choose(cfg, self.layout, self.group.nodes())
        if changed is not None:
            reporting.interval_chosen(self.log, self.cadence, changed, self.step, self.last)
        if self.first_step is None:
            self.first_step = time.perf_counter() - t_start
            reporting.first_step(self.log, self._say, self.cfg, self.last, self.first_step)
        progress.update(self.last, time.perf_counter() - t_start)

    def _submit_next(self, end: int) -> None:
        """Submit the next call behind the one in flight if nothing must happen between them."""
        quiet = (self.controls.stop is None and self.pending_resize is None and self.elastic.growing is None
                 and self.elastic.awaiting is None
                 and not self.controls.waiting() and not self.respread.under_way)
        self.calls.submit_next(self.cfg, end, self.checkpoints.last_step, quiet, self.cadence.every)

    def _report(self) -> None:
        """The job went on after a recovery or a resize: log how long that took."""
        reporting.closed(self.log, self._say, self.healing, self.resizing, self.step, self.last, self.moving)
        self.healing = self.resizing = self.moving = None

    def _survival(self) -> None:
        reporting.survival(self.log, self._say, self.layout, self.group.nodes(), self.group.placement,
                           self.copy.node if self.cadence.every else None)

    def _moved(self, moved) -> None:
        """Adopt the group of a stage moved off its twin's node (raytp.runtime.recovery.respread); a failure
        during the move is recovered from as a failed step is."""
        if moved is None:
            return
        self.adopt(moved.group)
        if moved.error is not None:
            self._recover(moved.error)
            return
        if moved.resizing is not None:  # a shrink off a drained node
            self.resizing = dataclasses.replace(moved.resizing, before=self.last.get("time"))
        else:
            self.moving = dataclasses.replace(moved.moving, before=self.last.get("time"))
        self._survival()

    def _recover(self, error: BaseException) -> None:
        self.state = State.RECOVERING
        self.publish()
        try:
            self.checkpoints.poll(self.group)  # a save every rank finished is still committed
        except FAILURES + (CheckpointError,):
            pass
        self.checkpoints.drop()
        ctx = recovery.RecoveryContext(self.log, self._say, self.spares, self.snapshots, self.copy, self.checkpoints)
        r = recovery.recover(ctx, self.group, error, self.step, self.failures)
        if isinstance(r, recovery.GaveUp):
            self.adopt(r.group)  # so that release() finds every actor the recovery started
            raise r.error
        self.calls.abandon()
        self.failures += r.failures
        reporting.unread_steps(self.log, r.replayed, self.step, r.step, self.cfg, self.layout)
        self.adopt(r.group)
        self.step, self.healing = r.step, r.healing
        if r.resizing is not None:
            self.resizing = dataclasses.replace(r.resizing, before=self.last.get("time"))
            self._say(f"no capacity for the lost workers: continuing at {self.layout} (grows back to "
                      f"DP={self.elastic.target_dp} when capacity returns)")
        self.state = State.RUNNING

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
        if self.controls.serve(self.layout, self.request_resize, self._profile):
            self.publish()

    def _profile(self, req: run_status.ProfileAsked) -> Outcome:
        ranks = None if req.ranks is None else list(req.ranks)
        return self.profiles.request(self.group, self.step, self.cfg.train.steps, req.steps, ranks, req.memory,
                                     req.id)

    def stop(self) -> None:
        """Stop at this step boundary on request: a checkpoint of the step reached, then release."""
        self.handle_requests()  # a stop filed meanwhile (`raytp stop` sends SIGTERM too) is answered as well
        path = self.save_checkpoint() if self.step > 0 else None
        self.state = State.STOPPED
        self.log.event("stopped", step=self.step, reason="requested", via=self.controls.stop.via,
                       checkpoint=str(path) if path else None)
        for rid in self.controls.stop.ids:
            self.controls.answer(rid, Outcome(ok=True, step=self.step, checkpoint=str(path) if path else None))
        self._say(f"stopped at step {self.step} on request" + (f"; checkpoint {path}" if path else ""))

    # -- resizes (carried out by Elastic; adopted here) ----------------------------------------
    @property
    def pending_resize(self):
        return self.elastic.pending

    def resize(self, *, tp: int | None = None, dp: int | None = None, pp: int | None = None,
               ep: int | None = None) -> Outcome:
        """Move to the layout with these degrees now: request, wait for the new ranks, switch (tests,
        benchmarks)."""
        try:
            target = self.layout.changed(tp=tp, dp=dp, pp=pp, ep=ep)
        except ValueError as e:  # degrees no layout has: refused, as a control request's are
            return Outcome.refused(str(e))
        outcome = self.request_resize(target)
        while outcome is None and self.elastic.awaiting is not None:  # no room yet: wait for it here
            time.sleep(0.2)
            outcome = self.advance_resize()
        if outcome is None:
            self.group.answered(self.elastic.pending.ready, timeout_s=self.cfg.runtime.placement_timeout_s)
            outcome = self.advance_resize(now=True)
        return outcome

    def request_resize(self, target: Layout, request_id: int | None = None) -> Outcome | None:
        """Begin a resize to `target`; its outcome, or None while its new ranks start (`request_id` is
        answered when it finishes). One with nothing to start (a shrink) switches at once."""
        got = self._take(self.elastic.request(self.group, target, self.step, request_id))
        return self.advance_resize() if got is None and self.elastic.due(self.group) else got

    def advance_resize(self, now: bool = False) -> Outcome | None:
        """At a step boundary: look again for room for a request waiting for it; switch to the pending
        layout if it is due (or `now`)."""
        retried = self.elastic.retry(self.group, self.step)
        if retried is not None:  # answered now (refused, or switched at once)
            outcome = self._take(retried[1])
            self.controls.answer(retried[0], outcome)
            return outcome
        if not self.elastic.due(self.group, now):
            return None
        self.state = State.RESIZING
        self.publish()
        request_id, got = self.elastic.finish(self.group, self.step)
        outcome = self._take(got)
        self.state = State.RUNNING
        self.controls.answer(request_id, outcome)
        return outcome

    def _take(self, got):
        """Adopt the group of a switch (resize.Switched); the outcome. A requested DP degree is the one an
        elastic job grows back to from then on (not the one it started at)."""
        if not isinstance(got, resize.Switched):
            return got
        self.adopt(got.group)
        if got.resizing is not None:
            self.resizing = dataclasses.replace(got.resizing, before=self.last.get("time"))
        if got.resizing is not None and got.resizing.reason.startswith("requested"):
            self.elastic.target_dp = got.group.layout.dp
        return got.outcome

    def logits(self, idx):
        """Full-vocabulary logits of a batch from replica 0 (for checks and tests)."""
        return self.group.logits(idx)

    def release(self) -> None:
        """Kill the actors and remove the placement groups (idempotent)."""
        if self.group is not None:
            self.group.release()
            self.controls.answer(*(self.elastic.release(self.group) or (None, None)))
            self.respread.release(self.group)
        self.copy.release()
        self.spares.release()
        self.controls.close()

    def say(self, msg: str) -> None:
        """A `[raytp]` line of the run's output (its stream and driver.log)."""
        print(f"[raytp] {msg}", file=self.out, flush=True)

    _say = say  # handed to the collaborators as their `say`
