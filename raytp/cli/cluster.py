"""Commands on a cluster's runs, from any machine that reaches it: submit, status, logs, stop, scale, profile."""
from __future__ import annotations

import time
from pathlib import Path

import click

from raytp import names
from raytp.cli.base import check_request, fail, load_job, main

ADDRESS_HELP = ("Ray cluster: its dashboard (http://HEAD:8265) or its GCS (HEAD:6379); default "
                "RAY_ADDRESS, else the cluster `ray start` made on this machine.")


def _head(address: str | None):
    from raytp.head import Head
    return Head(address)


def _cluster_errors(fn):
    """Unreachable heads and unknown runs end the command with one line and status 1."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from raytp.head import Unreachable
        from raytp.jobs import NoSuchRun
        try:
            return fn(*args, **kwargs)
        except (Unreachable, NoSuchRun, FileExistsError) as e:
            fail(e, 1)
    return wrapper


def await_outcome(ctl, rid: int, timeout_s: float, what: str, until=lambda outcome: True) -> dict:
    """The run's answer to request `rid` (the first one `until` accepts), or the end of the run."""
    import ray
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            outcome = ray.get(ctl.outcome.remote(rid), timeout=10)
        except ray.exceptions.RayActorError:
            return {"ok": True, "note": "the run has ended"}
        if outcome is not None and until(outcome):
            return outcome
        time.sleep(0.2)
    fail(f"no answer to the {what} request within {timeout_s:g}s (the run answers at step boundaries)", 1)


@main.command(epilog="\b\nThe run's Ray job is raytp-RUN; its entrypoint is `raytp train` on the head node, which "
                     "starts the run's\ncoordinator there (the run goes on if the entrypoint dies: `raytp attach "
                     "RUN`), and its run directory\n~/raytp/runs/RUN there unless --run-dir is given. Paths in the "
                     "job file (data.source,\nmodel.init_from, checkpoint.dir) are paths on the cluster.")
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.option("--address", default=None, help="The cluster's dashboard, http://HEAD:8265, or its GCS, HEAD:6379 "
              "(default: RAY_ADDRESS, else the cluster `ray start` made on this machine).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a job key, e.g. --set parallel.tp=4 (repeatable; beats the file).")
@click.option("--name", default=None, help="Run name (default: the job's name, else <job>-<timestamp>).")
@click.option("--run-dir", default=None, help="Run directory on the cluster (default: ~/raytp/runs/<name>).")
@click.option("--resume", is_flag=False, flag_value="latest", default=None, metavar="[PATH]",
              help="Resume from a checkpoint (a path or URL on the cluster), or alone from the newest whole "
                   "checkpoint of --run-dir (or checkpoint.dir); any valid layout, as with train.")
@click.option("--runtime-env", "runtime_env", default=None, metavar="FILE|JSON",
              help="A Ray runtime env (a YAML/JSON file, or inline JSON) merged into the run's: its env_vars "
                   "(NCCL settings, WANDB_API_KEY, HF_TOKEN), pip packages, container, ... reach the driver and "
                   "every worker.")
@_cluster_errors
def submit(job, address, sets, name, run_dir, resume, runtime_env):
    """Run JOB on a Ray cluster as a Ray job, checked here first; returns once it is submitted."""
    import tempfile
    from raytp import jobs
    cfg = load_job(job, sets)  # a bad job exits 2 here, before anything reaches the cluster
    try:
        extra = jobs.read_runtime_env(runtime_env) if runtime_env else None
    except ValueError as e:
        fail(f"--runtime-env: {e}")
    run = name or cfg.name or names.default_run_name(job)
    problem = names.check_run_name(run)
    if problem:
        fail(problem)
    head = _head(address)
    with tempfile.TemporaryDirectory(prefix="raytp-submit-") as staging:
        sub = jobs.make_submission(Path(job), sets, run, run_dir, cfg.runtime.step_timeout_s + 120, Path(staging),
                                   resume, extra)
        jobs.submit(head, sub)
    where = f" --address {address}" if address else ""
    click.echo(f"submitted run {run} as Ray job {sub.submission_id} to {head.dashboard}\n"
               f"  layout {cfg.layout}, {cfg.train.steps} steps; "
               f"run dir on the cluster: {sub.run_dir}"
               + (f"; resuming from {resume if resume != 'latest' else 'its newest checkpoint'}" if resume else "")
               + "\n"
               f"  follow it:  raytp status {run}{where}\n"
               f"              raytp logs {run} --follow{where}\n"
               f"  stop it:    raytp stop {run}{where}")


@main.command()
@click.argument("run", required=False)
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--ranks", is_flag=True, help="Also list which process holds each rank: actor, node, pid, GPU.")
@click.option("--storage", default=None, metavar="URL",
              help="Read RUN from the shared storage its job mirrored its records to (runtime.storage), not from "
                   "a cluster: works after the head is gone.")
@_cluster_errors
def status(run, address, ranks, storage):
    """State, step, layout, loss and tokens/s of RUN; of every run without RUN.

    A submitted run also shows its Ray job's status (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED),
    after it ended too."""
    check_request(run)  # a name, never a path: --storage reads <storage>/<RUN>
    if storage:
        from raytp.runtime.driver.mirror import describe_stored
        if not run:
            fail("--storage needs RUN (the run's name under that storage)")
        try:
            click.echo("\n".join(describe_stored(storage, run)))
        except FileNotFoundError as e:
            fail(str(e), 1)
        return
    from raytp import jobs
    head = _head(address)
    lines = jobs.describe(head, run, ranks=ranks) if run else jobs.all_runs(head)
    click.echo("\n".join(lines) if lines else "no raytp runs in this cluster")


@main.command()
@click.argument("run")
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the run writes, until its job ends.")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--storage", default=None, metavar="URL",
              help="Read RUN's driver output from the shared storage its job mirrored it to (runtime.storage), "
                   "not from a cluster: works after the head is gone.")
@_cluster_errors
def logs(run, follow, address, storage):
    """The output of submitted run RUN (its Ray job's driver log: progress, events, errors)."""
    check_request(run)
    if storage:
        from raytp.runtime.driver.mirror import read_log
        try:
            click.echo(read_log(storage, run), nl=False)
        except FileNotFoundError as e:
            fail(str(e), 1)
        return
    from raytp import jobs
    head = _head(address)
    if head.job(run) is None:
        raise jobs.NoSuchRun(f"no submitted run named {run!r} in this cluster (no Ray job "
                             f"{jobs.submission_id(run)}); a run started with `raytp train` logs to its "
                             "terminal and its run directory")
    if not follow:
        click.echo(head.logs(run), nl=False)
        return
    import asyncio

    async def tail():
        async for chunk in head.client().tail_job_logs(jobs.submission_id(run)):
            click.echo(chunk, nl=False)
    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        pass


@main.command()
@click.argument("run")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the run to stop.")
@_cluster_errors
def stop(run, address, timeout):
    """Stop RUN at its next step boundary, with a checkpoint of the step it reached.

    A submitted run is also stopped as a Ray job (SIGTERM to its driver, which stops the same way),
    so Ray records it as STOPPED; without a control actor to ask, that is the only way."""
    import ray
    from raytp import jobs
    check_request(run, timeout)
    head = _head(address)
    job = jobs.job_if_reachable(head, run)
    running = job is not None and not job.status.is_terminal()
    ctl = None
    if job is None or running:
        try:
            head.connect()
            from raytp.runtime.driver.control_actor import find_control
            ctl = find_control(run)
        except jobs.Unreachable:
            if job is None:
                raise
    if ctl is None and not running:
        if job is not None:
            fail(f"{run} is not running: Ray job {jobs.submission_id(run)} is {job.status.value}", 1)
        raise jobs.NoSuchRun(f"no running run named {run!r} in this cluster (see `raytp status`)")
    rid = ray.get(ctl.request.remote("stop"), timeout=30) if ctl is not None else None
    if running:
        head.client().stop_job(jobs.submission_id(run))
    # The driver answers every stop request it got (also when the SIGTERM reached it first): the step
    # it stopped at and its checkpoint.
    outcome = await_outcome(ctl, rid, timeout, "stop") if ctl is not None else {}
    if running:
        deadline = time.monotonic() + timeout
        while not head.client().get_job_status(jobs.submission_id(run)).is_terminal():
            if time.monotonic() > deadline:
                fail(f"Ray job {jobs.submission_id(run)} did not end within {timeout:g}s", 1)
            time.sleep(0.5)
        job = head.job(run)
    click.echo(f"[raytp] {run} stopped" + (f" at step {outcome['step']}" if "step" in outcome else "")
               + (f"; checkpoint {outcome['checkpoint']}" if outcome.get("checkpoint") else "")
               + (f"; Ray job {job.submission_id} {job.status.value}" if running else ""))


@main.command()
@click.argument("run")
@click.option("--workers", type=int, default=None, help="Total workers; keeps TP and sets DP = workers / TP.")
@click.option("--tp", type=int, default=None, help="New tensor-parallel degree.")
@click.option("--pp", type=int, default=None, help="New number of pipeline stages.")
@click.option("--dp", type=int, default=None, help="New data-parallel degree.")
@click.option("--ep", type=int, default=None, help="New expert-parallel degree (an MoE job).")
@click.option("--cp", type=int, default=None, help="New context-parallel degree (each sequence cut over CP ranks).")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the resize.")
@_cluster_errors
def scale(run, workers, tp, pp, dp, ep, cp, address, timeout):
    """Change RUN's layout while it trains: --workers N, or any of --tp, --cp, --pp, --dp, --ep."""
    import ray
    from raytp.runtime.driver.control_actor import find_control
    degrees = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep}
    if workers is None and all(n is None for n in degrees.values()):
        fail("give --workers N, or any of --tp N, --cp N, --pp N, --dp N, or --ep N")
    if workers is not None and any(n is not None for n in degrees.values()):
        fail("--workers keeps TP, CP and PP and sets DP; give either it or --tp/--cp/--pp/--dp/--ep")
    check_request(run, timeout, workers=workers, **degrees)
    _head(address).connect()
    ctl = find_control(run)
    if ctl is None:
        fail(f"no running run named {run!r} in this cluster (see `raytp status` for the runs it has)", 1)
    st = ray.get(ctl.get_status.remote(), timeout=30)
    replica = st["world_size"] // st["dp"]  # TP x CP x PP
    if workers is not None:
        if workers % replica:
            fail(f"--workers {workers} is not a multiple of the run's replica size (TP x CP x PP = {replica}); "
                  f"valid: {', '.join(str(replica * k) for k in range(1, 5))}, ...")
        degrees["dp"] = workers // replica
    # every degree not given is the run's: the request names them all but ep (a request names what it changes)
    degrees.update({a: st.get(a, 1) for a in ("tp", "cp", "pp", "dp") if degrees[a] is None})
    rid = ray.get(ctl.request.remote("scale", **degrees), timeout=30)
    outcome = await_outcome(ctl, rid, timeout, "scale")
    if not outcome.get("ok"):
        fail(f"scale refused; the run goes on unchanged: {outcome.get('error')}", 1)
    click.echo(f"[raytp] {run} now runs at {outcome.get('layout')} (step {outcome.get('step', '?')})"
               + (f"; {outcome['bytes'] / 1e6:.1f} MB moved" if outcome.get("bytes") else ""))


@main.command()
@click.argument("run")
@click.option("--steps", type=click.IntRange(min=1), required=True,
              help="How many steps to trace, from the run's next step boundary.")
@click.option("--ranks", default="0", show_default=True, help="The ranks that trace them, e.g. 0,1.")
@click.option("--memory", is_flag=True, help="Also record memory: allocations in the trace and, on cuda, a CUDA "
              "memory snapshot.")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the traces.")
@_cluster_errors
def profile(run, steps, ranks, memory, address, timeout):
    """Trace RUN's next --steps steps with torch.profiler on --ranks; say where the traces go, and wait for them.

    Each rank writes a Chrome trace (chrome://tracing, ui.perfetto.dev) under the run's checkpoint location:
    profiles/steps-FIRST-LAST/rankNNN.json, as the job's profile section does."""
    import ray
    from raytp.runtime.driver.control_actor import find_control
    try:
        wanted = sorted({int(r) for r in ranks.split(",")})
    except ValueError:
        fail(f"--ranks {ranks}: expected rank numbers separated by commas, e.g. 0,1")
    check_request(run, timeout)
    _head(address).connect()
    ctl = find_control(run)
    if ctl is None:
        fail(f"no running run named {run!r} in this cluster (see `raytp status` for the runs it has)", 1)
    rid = ray.get(ctl.request.remote("profile", steps=steps, ranks=wanted, memory=memory), timeout=30)
    taken = await_outcome(ctl, rid, timeout, "profile")
    if not taken.get("ok"):
        fail(f"profile refused; the run goes on unchanged: {taken.get('error')}", 1)
    if "steps" not in taken:
        fail(f"{run} ended before it took the request", 1)
    first, last = taken["steps"]
    click.echo(f"[raytp] {run} traces steps {first}-{last} on rank(s) {', '.join(map(str, taken['ranks']))}; "
               f"the traces go to {taken['where']}")
    done = await_outcome(ctl, rid, timeout, "profile", until=lambda outcome: outcome.get("written"))
    if not done.get("written"):
        fail(f"{run} ended before its step {last}: no traces were written", 1)
    if not done.get("ok"):
        fail(f"profile of steps {first}-{last}: {done.get('error')}", 1)
    click.echo("[raytp] written: " + ", ".join(done["files"])
               + (f" (none from rank(s) {', '.join(map(str, done['missing']))})" if done.get("missing") else ""))
