"""The Driver: places the workers, wires them, drives training, heals, releases.

It runs in the Ray driver process (``raytp train``) and is a small state
machine: SCHEDULING (reserve the placement group, start the actors, meet in
torch.distributed) -> RUNNING (streamed calls of ``steps_per_call`` steps,
evaluation, checkpoints) <-> RECOVERING (a worker died or hung: see
raytp.runtime.recovery) -> FINISHED, or FAILED / STOPPED. Whatever happens,
``release`` kills the actors and removes the placement group, and the run
directory keeps every line written so far.
"""
from __future__ import annotations

import enum
import sys
import time
from pathlib import Path

import ray
from ray.exceptions import ActorAlreadyExistsError

from raytp.config import JobConfig
from raytp.parallel.layout import Layout
from raytp.runtime import placement, recovery, resize
from raytp.runtime.control import start_control
from raytp.runtime.metrics import RunLog
from raytp.runtime.progress import Progress
from raytp.runtime.snapshots import OffNodeCopy, Snapshots
from raytp.runtime.spares import Spares, bundle_key
from raytp.runtime.worker import Worker, gpt_config
from raytp.train import checkpoint


class State(enum.Enum):
    SCHEDULING = "scheduling"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"


class Driver:
    worker_cls = Worker  # tests may swap in another class with the same methods

    def __init__(self, cfg: JobConfig, run_dir: Path, run: str, out=sys.stderr, ray_metrics: bool = True,
                 init_state: tuple[int, dict, str] | None = None):
        """`init_state`: (step, full one-device state, where from) to start from (a checkpoint or a
        Hugging Face model) instead of the seeded initialisation."""
        self.cfg, self.run_dir, self.run = cfg, Path(run_dir), run
        self.init_state = init_state
        self.ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.layout = Layout(cfg.parallel.tp, cfg.parallel.dp)
        self.log = RunLog(self.run_dir, run, ray_metrics)
        self.out = out
        self.state = State.SCHEDULING
        self.pgs: dict = {}  # dp_rank -> that replica's placement: a group, or a placement.Slots of
        #                      several on one node after a TP grow (see raytp.runtime.placement)
        self.control = None
        self.workers: list = []
        self.placement: list[dict] = []
        self.step = 0
        self.last: dict = {}
        self.first_step: float | None = None  # seconds from the command to the first completed step
        self.snapshots = Snapshots(self.layout.tp)
        self.snapshot_copy = OffNodeCopy(run)
        self.bundles: dict[str, tuple] = {}  # actor id -> (placement group id, bundle index) it sits in
        self.spares = Spares(self)
        self.failures = 0
        self.healing: dict | None = None  # set by a recovery until the next completed step
        self.resizing: dict | None = None  # set by a resize until the next completed step
        self.pending_resize = None  # a requested resize whose new ranks are starting (raytp.runtime.resize)
        self.stop_request: dict | None = None
        self.t_start = time.perf_counter()
        self.target_dp = cfg.parallel.dp  # an elastic job grows back to this after a shrink
        self.growing = None  # (placement groups, their ready refs) asked for to grow back
        self.saved_step: int | None = None
        self.logged = 0  # steps below this have their metrics.jsonl line
        self.partial: dict | None = None

    # -- lifecycle -----------------------------------------------------------------
    def run_to_end(self, t_start: float | None = None) -> dict:
        """Train to cfg.train.steps; returns the summary. Releases all resources on any exit.

        `t_start` (perf_counter) is when the user asked, for the time-to-first-step figure.
        """
        t_start = self.t_start = time.perf_counter() if t_start is None else t_start
        try:
            self.start()
            self.train_loop(t_start)
            summary = {"steps": self.step, "loss": self.last.get("loss"), "val_loss": self.last.get("val_loss"),
                       "seconds": time.perf_counter() - t_start, "failures": self.failures}
            if self.stop_request is None:
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
        cfg, lay = self.cfg, self.layout
        self.control = start_control(self.run)
        self.publish()
        self.log.event("started", run=self.run, tp=lay.tp, dp=lay.dp, world_size=lay.world_size,
                       device=cfg.runtime.device, steps=cfg.train.steps)
        self._say(f"placing {lay.world_size} workers ({lay}) ...")
        self.pgs = placement.reserve_replicas(cfg, self.run, lay.tp, list(range(lay.dp)),
                                              cfg.runtime.placement_timeout_s)
        self.workers = [self.new_worker(r) for r in range(lay.world_size)]
        if self.init_state is None:
            self.wire(fresh=set(range(lay.world_size)))
        else:  # every worker builds its shard from its slices of the state: no seeded initialisation
            self.wire(fresh=set(range(lay.world_size)), full=ray.put(self.init_state[1]))
        if cfg.recovery.snapshot_every:
            self.snapshot_copy.update(self)  # its keeper starts while the first step runs
        self.spares.start()  # in the background, like the keeper
        if self.init_state is not None:
            step, full, source = self.init_state
            self.step = self.logged = step
            self.log.event("resumed", step=step, source=source)
            self._say(f"starting at step {step} from {source}")
            self.init_state = None  # free the driver's copy
        self.state = State.RUNNING

    def new_worker(self, rank: int, timeout_s: float = 30.0, at: tuple | None = None):
        """Start the actor of `rank` (threaded, so it answers pings while a step runs). A replacement
        may have to wait a moment for Ray to release the dead actor's name. `at`: (job config,
        dp_rank -> placement) of a layout not yet switched to (a resize starting ranks ahead)."""
        remote = ray.remote(self.worker_cls)
        cfg, pgs = at if at is not None else (self.cfg, self.pgs)
        dp_rank, tp_rank = Layout(cfg.parallel.tp, cfg.parallel.dp).coords(rank)
        opts = placement.worker_options(cfg, pgs[dp_rank], self.run, rank, tp_rank)
        pg, index = placement.bundle_of(pgs[dp_rank], tp_rank)
        self.spares.evict(pg, index)  # a spare that drifted into this rank's bundle makes room
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                actor = remote.options(**opts, max_concurrency=4).remote(cfg.to_dict(), rank)
                self.bundles[actor._actor_id.hex()] = bundle_key(pg, index)
                return actor
            except ActorAlreadyExistsError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wire(self, fresh: set[int], job: dict | None = None, renumber: bool = False, full=None) -> None:
        """Rendezvous at rank 0's node and build the process groups: new workers (`fresh`) also build
        their shard (`setup`); the others keep their state and only `rejoin` (with the job as it now
        is, if `job` is given, and their position in self.workers as rank if `renumber`).

        With `full` (a one-device state or its ObjectRef: a TP resize), every worker builds its shard
        at the new TP degree from its slices of it, with no seeded initialisation: new workers in
        `setup`, the others (kept processes) in `reshape`, as rank = their position in self.workers."""
        workers, lay = self.workers, self.layout
        timeout = self.cfg.runtime.placement_timeout_s + self.cfg.runtime.collective_timeout_s
        init_method = ray.get(workers[0].rendezvous_address.remote(), timeout=timeout)
        if full is not None:
            job = self.cfg.to_dict() if job is None else job
            calls = [w.setup.remote(lay.tp, lay.dp, init_method, full) if r in fresh
                     else w.reshape.remote(lay.tp, lay.dp, init_method, job, r, full)
                     for r, w in enumerate(workers)]
        else:
            calls = [w.setup.remote(lay.tp, lay.dp, init_method) if r in fresh
                     else w.rejoin.remote(lay.tp, lay.dp, init_method, job, r if renumber else None)
                     for r, w in enumerate(workers)]
        ray.get(calls, timeout=timeout)
        self.placement = ray.get([w.where.remote() for w in workers], timeout=timeout)
        self.log.event("placed", ranks=self.placement)

    def set_state(self, full: dict) -> None:
        """Give every worker its slices of a full state, through the object store (one copy)."""
        ref = ray.put(full)
        ray.get([w.set_state.remote(ref) for w in self.workers], timeout=self.cfg.runtime.step_timeout_s)

    def shard_states(self) -> list[dict]:
        """The TP shards of replica 0 (DP replicas hold the same), rank order."""
        return ray.get([w.get_state.remote() for w in self.workers[:self.layout.tp]],
                       timeout=self.cfg.runtime.step_timeout_s)

    def save_checkpoint(self, shards: list[dict] | None = None) -> Path:
        t0 = time.perf_counter()
        path = checkpoint.save(self.ckpt_root, self.step, shards or self.shard_states(), gpt_config(self.cfg),
                               self.layout.tp, self.layout.dp, self.cfg.checkpoint.keep)
        size = sum(f.stat().st_size for f in path.iterdir())
        self.saved_step = self.step
        self.log.event("checkpoint", step=self.step, path=str(path), bytes=size,
                       seconds=time.perf_counter() - t0)
        return path

    # -- training ------------------------------------------------------------------
    def train_loop(self, t_start: float | None = None, until: int | None = None) -> None:
        """Train from self.step to `until` (default: the job's last step), healing failures on the way."""
        cfg = self.cfg
        t_start = time.perf_counter() if t_start is None else t_start
        end = cfg.train.steps if until is None else min(until, cfg.train.steps)
        progress = Progress(cfg.train.steps, self.out)
        try:
            while self.step < end or self._final_save_due():
                self.handle_requests()
                resize.maybe_finish(self)
                resize.maybe_grow(self)
                self.spares.refill()
                if self.stop_request is not None:
                    resize.cancel(self, "the run was stopped")
                    self.stop()
                    return
                try:
                    if self.step < end:
                        self._call(end, t_start, progress)
                    else:  # the last step's checkpoint, cut short by a failure: saved after recovery
                        self.save_checkpoint()
                except recovery.FAILURES as e:
                    self.state = State.RECOVERING
                    self.publish()
                    recovery.recover(self, e)
                    self.state = State.RUNNING
                self.publish()
        finally:
            progress.close()

    def _final_save_due(self) -> bool:
        steps, every = self.cfg.train.steps, self.cfg.checkpoint.every
        return bool(every) and self.step == steps and self.saved_step != steps

    def _call(self, end: int, t_start: float, progress: Progress) -> None:
        """One streamed call of up to steps_per_call steps, then evaluation and checkpoint if due."""
        cfg = self.cfg
        steps, every, save_every = cfg.train.steps, cfg.train.eval_interval, cfg.checkpoint.every
        snap = cfg.recovery.snapshot_every
        # The first call runs one step, so the first completed step shows at once; so does every call
        # while a resize waits for its new ranks, so that it takes over as soon as they are up.
        n = min(cfg.train.steps_per_call if self.first_step is not None and self.pending_resize is None else 1,
                end - self.step)
        for interval in (every, save_every):  # end the call at the next evaluation/save boundary
            if interval:
                n = min(n, interval - self.step % interval)
        start = self.step
        if save_every and self.saved_step != start and start % save_every == 0 and start > 0:
            self.save_checkpoint()  # a save interrupted by a failure, redone after recovery
        streams = [w.run_steps.options(num_returns="streaming").remote(start, n, snap) for w in self.workers]
        deadline = cfg.runtime.step_timeout_s
        for step in range(start, start + n):
            recs = []
            for rank, stream in enumerate(streams):
                recs.append(ray.get(self._next(stream, deadline)))
                self.partial = recs[0]  # rank 0's figures of a step cut short, for recovery
                dp_rank, tp_rank = self.layout.coords(rank)
                if snap and dp_rank == 0 and (step + 1) % snap == 0:
                    self.snapshots.add(step + 1, tp_rank, self._next(stream, deadline))
            self.step = step + 1
            self.last = self._record(recs[0], recs)
            if self.step == steps or (every and self.step % every == 0):
                self.last["val_loss"] = self.evaluate()
            self.log_step(self.last)
            if snap:
                self.snapshot_copy.update(self)
            if self.healing is not None:
                recovery.healed(self)
            if self.resizing is not None:
                resize.resized(self)
        if save_every and (self.step % save_every == 0 or self.step == steps):
            self.save_checkpoint()
        if self.first_step is None:
            self.first_step = time.perf_counter() - t_start
            self.log.event("first_step", seconds=self.first_step)
        progress.update(self.last, time.perf_counter() - t_start)

    # -- control -------------------------------------------------------------------
    def status(self) -> dict:
        """What `raytp status` shows."""
        return {"state": self.state.value, "step": self.step, "steps": self.cfg.train.steps,
                "tp": self.layout.tp, "dp": self.layout.dp, "world_size": self.layout.world_size,
                "loss": self.last.get("loss"), "val_loss": self.last.get("val_loss"),
                "tokens_per_s": self.last.get("tokens_per_s"), "step_time_s": self.last.get("step_time_s"),
                "failures": self.failures, "spares": len(self.spares.pool),
                "run_dir": str(self.run_dir.resolve()),
                "elapsed_s": time.perf_counter() - self.t_start}

    def publish(self) -> None:
        if self.control is not None:
            self.control.publish.remote(self.status())

    def handle_requests(self) -> None:
        """Requests filed through the control actor, served at this step boundary."""
        if self.control is None:
            return
        try:
            requests = ray.get(self.control.take_requests.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            self._say("the control actor was lost; starting a new one (pending requests are dropped)")
            self.control = start_control(self.run)
            return
        for req in requests:
            if req["kind"] == "stop":
                self.stop_request = req
            elif req["kind"] == "scale":
                outcome = resize.request(self, req["tp"], req["dp"], req["id"])
                if outcome is not None:  # else answered when the new layout takes over (resize.maybe_finish)
                    self.control.answer.remote(req["id"], outcome)
                self.publish()
            else:
                self.control.answer.remote(req["id"], {"ok": False, "error": f"unknown request {req['kind']!r}"})

    def stop(self) -> None:
        """Stop at this step boundary on request: a checkpoint of the step reached, then release."""
        path = None
        if self.step > 0 and self.saved_step != self.step:
            path = self.save_checkpoint()
        self.state = State.STOPPED
        self.log.event("stopped", step=self.step, reason="requested", checkpoint=str(path) if path else None)
        self.control.answer.remote(self.stop_request["id"], {"ok": True, "step": self.step,
                                                             "checkpoint": str(path) if path else None})
        self._say(f"stopped at step {self.step} on request" + (f"; checkpoint {path}" if path else ""))

    @staticmethod
    def _next(stream, timeout: float):
        """The next object of a streaming call, or StepDeadline if none comes within `timeout`. The object
        stays where it was made: fetch_local=False, or every snapshot would be pulled to the driver's
        node before the next step is taken (a full model's state per step, over the network)."""
        ready, _ = ray.wait([stream], timeout=timeout, fetch_local=False)
        if not ready:
            raise recovery.StepDeadline(f"no progress within runtime.step_timeout_s={timeout:g}s")
        return next(stream)

    def log_step(self, rec: dict) -> None:
        """One metrics.jsonl line per step: steps replayed after a rollback are not written again."""
        if rec["step"] >= self.logged:
            self.log.metric(rec)
            self.logged = rec["step"] + 1

    def _record(self, rec: dict, all_ranks: list[dict]) -> dict:
        """metrics.jsonl's line for one step: rank 0's figures, the slowest rank's time."""
        step_time = max(r["step_time_s"] for r in all_ranks)
        tokens_per_step = self.cfg.train.batch_size * self.cfg.model.block_size
        return {"step": rec["step"], "loss": rec["loss"], "lr": rec["lr"], "grad_norm": rec["grad_norm"],
                "tokens": tokens_per_step * (rec["step"] + 1), "step_time_s": step_time,
                "tokens_per_s": tokens_per_step / step_time, "comm_s": rec["comm_s"],
                "tp": self.layout.tp, "dp": self.layout.dp, "time": time.time()}

    def logits(self, idx) -> "torch.Tensor":
        """Full-vocabulary logits of a batch from replica 0 (for checks and tests)."""
        return ray.get([w.logits.remote(idx) for w in self.workers[:self.layout.tp]],
                       timeout=self.cfg.runtime.step_timeout_s)[0]

    def evaluate(self) -> float:
        return ray.get([w.evaluate.remote(self.step) for w in self.workers],
                       timeout=self.cfg.runtime.step_timeout_s)[0]

    def release(self) -> None:
        """Kill the actors and remove the placement group (idempotent)."""
        placement.kill(self.workers)
        resize.cancel(self, "the run ended")
        self.workers = []
        self.snapshot_copy.release()
        self.spares.release()
        placement.release(self.pgs.values())
        self.pgs = {}
        if self.growing is not None:
            placement.release(self.growing[0].values())
            self.growing = None
        if self.control is not None:
            try:
                ray.kill(self.control)
            except Exception:  # noqa: BLE001
                pass
            self.control = None

    def _say(self, msg: str) -> None:
        print(f"[raytp] {msg}", file=self.out, flush=True)
