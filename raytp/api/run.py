"""`raytp.train`: a job run to its end from this process, as `raytp train` runs it.

    import raytp
    result = raytp.train("jobs/default.yaml", overrides={"train.steps": 100})
    print(result.steps, result.loss, result.checkpoint)

Ray: a process already connected to Ray (a Ray Tune trainable, a script that called ray.init) runs the
job on that cluster and stays connected; otherwise `address` (or RAY_ADDRESS) is joined, or an
embedded local Ray is started on loopback, and either is left again at the end.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import TextIO

from raytp import names
from raytp.api import job as job_mod
from raytp.api.errors import BadJob, Interrupted, RunFailed, message_of
from raytp.api.result import Result, read_events


def train(job: job_mod.JobSpec, overrides: job_mod.Overrides = None, address: str | None = None,
          run_dir: str | os.PathLike | None = None, resume: bool | str | os.PathLike = False,
          name: str | None = None, *, out: TextIO | None = None) -> Result:
    """Run `job` to its end and return its Result.

    `job`: a YAML job file's path, a dict of sections (as the file has them), or a JobConfig.
    `overrides`: as `--set`: a dict {"train.lr": 3e-4} or a list of "train.lr=3e-4" strings.
    `address`: the Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray); ignored when
    this process is connected to Ray already. `run_dir`, `name`: as --run-dir, --name. `resume`: True
    for this run's newest checkpoint, or a checkpoint or run directory (path or URL) to start from.
    `out`: where the `[raytp]` and `warning:` lines go (default: stderr).

    Raises BadJob (`raytp train` exits 2) before anything starts, or once the workers find the checkpoint
    location out of their reach; RunFailed (exit 1) when the run fails; Interrupted, a KeyboardInterrupt,
    on Ctrl-C. SIGTERM, in the main thread, stops the run at its next step boundary with a checkpoint
    (as `raytp stop`); the Result then says "stopped".
    """
    t0 = time.perf_counter()
    out = out or sys.stderr

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    coordinated = not _connected() and bool(address or os.environ.get("RAY_ADDRESS"))
    joined = coordinated or _connected()
    plan = job_mod.plan(job, overrides, run_dir, name, job_mod.resume_spec(resume), not joined, say)
    if coordinated:  # the run is driven by a detached actor in the cluster: it outlives this process
        return _train_coordinated(plan, address, resume, t0, out, say)
    cfg, path = plan.cfg, plan.run_dir
    job_mod.check_fresh(path, job_mod.resume_spec(resume))
    _begin(plan, say)

    with _ray(address, cfg) as embedded:
        if not embedded:
            _check_cluster_memory(cfg, plan.memory)
        from raytp.files.storage import StorageError
        from raytp.runtime.driver.driver import Driver
        from raytp.runtime.errors import DoesNotFit
        try:
            driver = Driver(cfg, path, plan.run, out=out, init_state=plan.init_state, memory=plan.memory)
            with _stop_on_sigterm(driver):
                summary = driver.run_to_end(t_start=t0)
        except KeyboardInterrupt:
            raise Interrupted(path) from None
        except (StorageError, DoesNotFit) as e:  # a location not every worker reaches, a share no GPU holds
            raise BadJob(message_of(e)) from e
        except Exception as e:  # noqa: BLE001 - the run dir's events.jsonl says more
            raise RunFailed(message_of(e), path) from e
        newest = driver.checkpoints.newest() if driver.checkpoints.committed is not None else None
        summary = {**summary, "checkpoint": newest.where if newest is not None else None, "layout": driver.layout}
    return _result(plan, summary)


def _train_coordinated(plan, address, resume, t0: float, out, say) -> Result:
    """Start the run's coordinator in the cluster and follow it to its end (raytp.api.follow)."""
    from raytp.api import follow
    t0_wall = time.time() - (time.perf_counter() - t0)
    with _ray(address, plan.cfg), follow.sigterm_flag() as asked:  # after ray.init, which sets its own handler
        refusal = follow.alive(plan.run)
        if refusal:
            raise BadJob(refusal)
        job_mod.check_fresh(plan.run_dir, job_mod.resume_spec(resume))
        _begin(plan, say)
        _check_cluster_memory(plan.cfg, plan.memory)
        actor = follow.start(plan, t0_wall)
        summary = follow.outcome(follow.follow(actor, plan.run, out, 0, True, asked), plan.run_dir)
    return _result(plan, summary)


def _begin(plan, say) -> None:
    """The run directory with the job as it runs (config.yaml), and the run's first line."""
    import yaml
    from raytp.files.checkpoint_owner import keep_run_id
    cfg, path = plan.cfg, plan.run_dir
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    keep_run_id(path, plan.run_id)
    say(f"[raytp] run {plan.run}  dir {path}  layout {cfg.layout}  "
        f"device {cfg.runtime.device}  memory {plan.memory.line()}")


def _result(plan, summary: dict) -> Result:
    path = plan.run_dir
    return Result(run=plan.run, run_dir=path, state=summary["state"], steps=summary["steps"], loss=summary["loss"],
                  val_loss=summary["val_loss"], seconds=summary["seconds"], failures=summary["failures"],
                  checkpoint=summary["checkpoint"], layout=summary["layout"], events=read_events(path))


def _connected() -> bool:
    """Whether this process is connected to Ray already (Ray is imported by whoever connected it)."""
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


@contextmanager
def _ray(address: str | None, cfg):
    """Ray for the run: the connection this process has, else `address` (or RAY_ADDRESS) joined, else a
    fresh embedded local instance; yields whether it is embedded. What is connected here is left at the end."""
    if _connected():
        yield False
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if not address and "ray" not in sys.modules:
        # An embedded instance serves this machine only: bind it to loopback. (Ray reads
        # this at import; despite its name it selects the loopback address on Linux too.)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if address:
        from raytp.head import use_token_if_present
        use_token_if_present()
    import ray
    if address:
        ray.init(address=address, namespace=names.NAMESPACE, log_to_driver=True)
    else:  # a fresh local instance, deliberately ("local" never joins a stale cluster)
        needed = cfg.world_size * cfg.runtime.cpus_per_worker
        ray.init(address="local", namespace=names.NAMESPACE, num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)),
                 include_dashboard=False, log_to_driver=True)
    try:
        yield not address
    finally:
        ray.shutdown()


def _check_cluster_memory(cfg, memory) -> None:
    """A joined cluster: some alive node must hold one TP group's workers (BadJob before any placement)."""
    import ray
    from raytp.runtime import estimate
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    biggest = max((n["Resources"].get("memory", 0.0) for n in nodes), default=0.0)
    problem = estimate.refusal(memory, cfg.parallel.tp, int(biggest), "the cluster's largest node")
    if problem:
        if estimate.zero_fits(cfg, int(biggest)):
            problem += f"; or shard the AdamW state over the {cfg.parallel.dp} replicas: parallel.zero: 1 fits"
        pp = estimate.pp_that_fits(cfg, int(biggest))
        if pp is not None:
            problem += f"; or split the layers into stages: parallel.pp: {pp} fits (each stage's TP group on a node)"
        raise BadJob(problem)


@contextmanager
def _stop_on_sigterm(driver):
    """SIGTERM (what `ray job stop` and `raytp stop` of a submitted run send) stops the run at its next
    step boundary, with a checkpoint, like `raytp stop`; the driver then releases everything. Only the
    main thread can take a signal (a Ray Tune trainable runs in another); the old handler is put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import signal
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: driver.request_stop(via="SIGTERM"))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
