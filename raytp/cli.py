"""The `raytp` command line.

    raytp train jobs/default.yaml --set parallel.tp=4

A job file is loaded and checked before anything else happens: a bad file or
override exits with status 2 and one line per problem, before Ray starts.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from raytp import config as config_mod

EXIT_BAD_CONFIG = 2


def _keys_help() -> str:
    lines = ["\b", "Job file keys (section.key  type  default  help):"]
    for key, typ, default, help_ in config_mod.describe():
        lines.append(f"  {key:<30} {typ:<8} {default:<10} {help_}")
    return "\n".join(lines)


def _load_job(job: str, sets: tuple[str, ...]) -> config_mod.JobConfig:
    try:
        return config_mod.load(job, sets)
    except config_mod.ConfigError as e:
        for line in e.problems:
            click.echo(f"error: {line}", err=True)
        sys.exit(EXIT_BAD_CONFIG)


def _check_data(cfg: config_mod.JobConfig) -> None:
    src = cfg.data.source
    if src != "builtin" and not Path(src).expanduser().exists():
        click.echo(f"error: data.source: {src} does not exist; valid: 'builtin', a directory of text files, "
                   "or a .bin file of uint16 token ids", err=True)
        sys.exit(EXIT_BAD_CONFIG)


def run_name_and_dir(job: str, cfg: config_mod.JobConfig, run_dir: str | None, name: str | None) -> tuple[str, Path]:
    """RUN is the last component of the run dir unless --name (or the job's name) is given."""
    if run_dir:
        path = Path(run_dir).expanduser()
        return name or path.resolve().name, path
    name = name or cfg.name or f"{Path(job).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    return name, Path("runs") / name


def connect_ray(address: str | None, cfg: config_mod.JobConfig) -> bool:
    """Join the cluster at `address` (or RAY_ADDRESS), else start an embedded local one. True if embedded."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address and "ray" not in sys.modules:
        # An embedded instance serves this machine only: bind it to loopback. (Ray reads
        # this at import; despite its name it selects the loopback address on Linux too.)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if address:
        from raytp.jobs import use_token_if_present
        use_token_if_present()
    import ray
    if address:
        ray.init(address=address, namespace="raytp", log_to_driver=True)
        return False
    # A fresh local instance, deliberately ("local" never joins a stale cluster).
    needed = cfg.world_size * cfg.runtime.cpus_per_worker
    ray.init(address="local", namespace="raytp", num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)),
             include_dashboard=False, log_to_driver=True)
    return True


@click.group()
@click.version_option(package_name="raytp")
def main():
    """raytp: tensor-parallel GPT training on Ray that survives failures and rescales."""


def _fail(msg: str, code: int = EXIT_BAD_CONFIG):
    for line in str(msg).splitlines():
        click.echo(f"error: {line}", err=True)
    sys.exit(code)


@main.command(epilog=_keys_help())
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a job key, e.g. --set parallel.tp=4 (repeatable; beats the file).")
@click.option("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray).")
@click.option("--run-dir", default=None, help="Run directory (default: runs/<name>).")
@click.option("--name", default=None, help="Run name (default: the run directory's last component).")
@click.option("--resume", is_flag=False, flag_value="latest", default=None, metavar="[PATH]",
              help="Resume from a checkpoint dir, or the newest whole checkpoint of a run dir; "
                   "alone, from this run's own. Any valid layout: weights and optimizer state are resharded.")
def train(job, sets, address, run_dir, name, resume):
    """Train the model of JOB (a YAML job file) on a Ray cluster."""
    t0 = time.perf_counter()
    cfg = _load_job(job, sets)
    _check_data(cfg)
    run, path = run_name_and_dir(job, cfg, run_dir, name)
    from raytp.runtime.origin import starting_state
    from raytp.train.checkpoint import CheckpointError
    try:
        cfg, init_state = starting_state(cfg, resume, path, say=lambda m: click.echo(f"[raytp] {m}", err=True))
    except (CheckpointError, ValueError) as e:
        _fail(e)
    except config_mod.ConfigError as e:
        _fail("\n".join(e.problems))
    if (path / "metrics.jsonl").exists() and resume != "latest":
        _fail(f"run directory {path} already holds a run; pass --resume to continue it, or another --run-dir/--name")
    path.mkdir(parents=True, exist_ok=True)
    import yaml
    (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    click.echo(f"[raytp] run {run}  dir {path}  layout TP={cfg.parallel.tp} x DP={cfg.parallel.dp}  "
               f"device {cfg.runtime.device}", err=True)

    embedded = connect_ray(address, cfg)
    import ray
    from raytp.runtime.driver import Driver
    from raytp.runtime.placement import PlacementError
    try:
        driver = Driver(cfg, path, run, init_state=init_state)
        _stop_on_sigterm(driver)
        summary = driver.run_to_end(t_start=t0)
    except PlacementError as e:
        _fail(e, 1)
    except KeyboardInterrupt:
        click.echo(f"[raytp] interrupted; workers released, run dir {path} kept", err=True)
        sys.exit(130)
    finally:
        if embedded:
            ray.shutdown()
    val, loss = summary.get("val_loss"), summary.get("loss")
    ended = "stopped after" if summary.get("state") == "stopped" else "finished"
    click.echo(f"[raytp] {ended} {summary['steps']} steps in {summary['seconds']:.1f}s"
               + (f": loss {loss:.4f}" if loss is not None else "")
               + (f", val_loss {val:.4f}" if val is not None else "") + f"; run dir {path}", err=True)


def _stop_on_sigterm(driver) -> None:
    """SIGTERM (what `ray job stop` and `raytp stop` of a submitted run send) stops the run at its next
    step boundary, with a checkpoint, like `raytp stop`; the driver then releases everything."""
    import signal

    def handler(signum, frame):
        driver.request_stop(via="SIGTERM")
    signal.signal(signal.SIGTERM, handler)


@main.command()
@click.argument("source", type=click.Path(exists=True))
@click.option("--out", required=True, type=click.Path(), help="Output file (raytp) or directory (hf).")
@click.option("--format", "fmt", type=click.Choice(["raytp", "hf"]), default="raytp", show_default=True,
              help="raytp: one file raytp.model.GPT.load reads; hf: a GPT-2 directory for transformers.")
def export(source, out, fmt):
    """Write one unsharded model from SOURCE (a run dir or a checkpoint dir)."""
    from raytp.model import GPT, GPTConfig
    from raytp.train import checkpoint
    try:
        ckpt, manifest, full = checkpoint.load_latest(
            Path(source), warn=lambda m: click.echo(f"[raytp] warning: {m}", err=True))
    except checkpoint.CheckpointError as e:
        _fail(e, 1)
    cfg = GPTConfig(**manifest["model"])
    if fmt == "hf":
        from raytp.train import hf
        hf.save_hf(full["model"], cfg, Path(out))
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        GPT.from_state_dict(cfg, full["model"], where=str(ckpt)).save(out)
    click.echo(f"[raytp] exported step {manifest['step']} of {ckpt} ({fmt}) to {out}", err=True)


@main.command()
@click.argument("model_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompt", default="\n", show_default=True, help="Text to continue (byte-level models).")
@click.option("--tokens", default=200, show_default=True, help="Tokens to generate.")
@click.option("--temperature", default=0.8, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=None, type=int, help="Sample among the k likeliest tokens only.")
@click.option("--seed", default=0, show_default=True)
def sample(model_file, prompt, tokens, temperature, top_k, seed):
    """Generate text from MODEL_FILE (written by `raytp export`)."""
    import torch
    from raytp.model import GPT
    try:
        model = GPT.load(model_file)
    except ValueError as e:
        _fail(e, 1)
    if model.cfg.vocab_size > 256:
        _fail(f"{model_file}: vocabulary of {model.cfg.vocab_size} is not byte level; sample decodes bytes only", 1)
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    out = model.generate(idx, tokens, temperature=temperature, top_k=top_k, generator=g)
    click.echo(bytes(out[0].tolist()).decode("utf-8", errors="replace"))


# -- a cluster's runs: submit, status, logs, stop, scale -------------------------------------
ADDRESS_HELP = ("Ray cluster: its dashboard (http://HEAD:8265) or its GCS (HEAD:6379); default "
                "RAY_ADDRESS, else the cluster `ray start` made on this machine.")


def _head(address: str | None):
    from raytp.jobs import Head
    return Head(address)


def _cluster_errors(fn):
    """Unreachable heads and unknown runs end the command with one line and status 1."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from raytp.jobs import NoSuchRun, Unreachable
        try:
            return fn(*args, **kwargs)
        except (Unreachable, NoSuchRun, FileExistsError) as e:
            _fail(e, 1)
    return wrapper


def _await(ctl, rid: int, timeout_s: float, what: str) -> dict:
    import ray
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            outcome = ray.get(ctl.outcome.remote(rid), timeout=10)
        except ray.exceptions.RayActorError:
            return {"ok": True, "note": "the run has ended"}
        if outcome is not None:
            return outcome
        time.sleep(0.2)
    _fail(f"no answer to the {what} request within {timeout_s:g}s (the run answers at step boundaries)", 1)


@main.command(epilog="\b\nThe run's Ray job is raytp-RUN; its driver is `raytp train` on the head node, and its "
                     "run directory\n~/raytp/runs/RUN there unless --run-dir is given. Paths in the job file "
                     "(data.source,\nmodel.init_from, checkpoint.dir) are paths on the cluster.")
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.option("--address", default=None, help="The cluster's dashboard, http://HEAD:8265, or its GCS, HEAD:6379 "
              "(default: RAY_ADDRESS, else the cluster `ray start` made on this machine).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a job key, e.g. --set parallel.tp=4 (repeatable; beats the file).")
@click.option("--name", default=None, help="Run name (default: the job's name, else <job>-<timestamp>).")
@click.option("--run-dir", default=None, help="Run directory on the cluster (default: ~/raytp/runs/<name>).")
@_cluster_errors
def submit(job, address, sets, name, run_dir):
    """Run JOB on a Ray cluster as a Ray job, checked here first; returns once it is submitted."""
    import tempfile
    from raytp import jobs
    cfg = _load_job(job, sets)  # a bad job exits 2 here, before anything reaches the cluster
    run = name or cfg.name or f"{Path(job).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    problem = jobs.check_run_name(run)
    if problem:
        _fail(problem)
    head = _head(address)
    with tempfile.TemporaryDirectory(prefix="raytp-submit-") as staging:
        sub = jobs.make_submission(Path(job), sets, run, run_dir, cfg.runtime.step_timeout_s + 120, Path(staging))
        jobs.submit(head, sub)
    where = f" --address {address}" if address else ""
    click.echo(f"submitted run {run} as Ray job {sub.submission_id} to {head.dashboard}\n"
               f"  layout TP={cfg.parallel.tp} x DP={cfg.parallel.dp}, {cfg.train.steps} steps; "
               f"run dir on the cluster: {sub.run_dir}\n"
               f"  follow it:  raytp status {run}{where}\n"
               f"              raytp logs {run} --follow{where}\n"
               f"  stop it:    raytp stop {run}{where}")


@main.command()
@click.argument("run", required=False)
@click.option("--address", default=None, help=ADDRESS_HELP)
@_cluster_errors
def status(run, address):
    """State, step, layout, loss and tokens/s of RUN; of every run without RUN.

    A submitted run also shows its Ray job's status (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED),
    after it ended too."""
    from raytp import jobs
    head = _head(address)
    lines = jobs.describe(head, run) if run else jobs.all_runs(head)
    click.echo("\n".join(lines) if lines else "no raytp runs in this cluster")


@main.command()
@click.argument("run")
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the run writes, until its job ends.")
@click.option("--address", default=None, help=ADDRESS_HELP)
@_cluster_errors
def logs(run, follow, address):
    """The output of submitted run RUN (its Ray job's driver log: progress, events, errors)."""
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
    head = _head(address)
    job = jobs.job_if_reachable(head, run)
    running = job is not None and not job.status.is_terminal()
    ctl = None
    if job is None or running:
        try:
            head.connect()
            from raytp.runtime.control import find_control
            ctl = find_control(run)
        except jobs.Unreachable:
            if job is None:
                raise
    if ctl is None and not running:
        if job is not None:
            _fail(f"{run} is not running: Ray job {jobs.submission_id(run)} is {job.status.value}", 1)
        raise jobs.NoSuchRun(f"no running run named {run!r} in this cluster (see `raytp status`)")
    rid = ray.get(ctl.request.remote("stop"), timeout=30) if ctl is not None else None
    if running:
        head.client().stop_job(jobs.submission_id(run))
    outcome = _await(ctl, rid, timeout, "stop") if ctl is not None else {}
    if running:
        deadline = time.monotonic() + timeout
        while not head.client().get_job_status(jobs.submission_id(run)).is_terminal():
            if time.monotonic() > deadline:
                _fail(f"Ray job {jobs.submission_id(run)} did not end within {timeout:g}s", 1)
            time.sleep(0.5)
        job = head.job(run)
        if "step" not in outcome:  # no answer from a control actor: the job's log says where it stopped
            log = head.logs(run)
            outcome = jobs.stop_point(log) or {"last": jobs.progress_of(log)[1]}
    click.echo(f"[raytp] {run} stopped" + (f" at step {outcome['step']}" if "step" in outcome else "")
               + (f"; checkpoint {outcome['checkpoint']}" if outcome.get("checkpoint") else "")
               + (f"; Ray job {job.submission_id} {job.status.value}" if running else "")
               + (f"\n  last: {outcome['last']}" if outcome.get("last") else ""))


@main.command()
@click.argument("run")
@click.option("--workers", type=int, default=None, help="Total workers; keeps TP and sets DP = workers / TP.")
@click.option("--tp", type=int, default=None, help="New tensor-parallel degree.")
@click.option("--dp", type=int, default=None, help="New data-parallel degree.")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the resize.")
@_cluster_errors
def scale(run, workers, tp, dp, address, timeout):
    """Change RUN's layout while it trains: --workers N, or --tp N and/or --dp M."""
    import ray
    from raytp.runtime.control import find_control
    if workers is None and tp is None and dp is None:
        _fail("give --workers N, or --tp N and/or --dp M")
    if workers is not None and (tp is not None or dp is not None):
        _fail("--workers keeps TP and sets DP; give either it or --tp/--dp")
    _head(address).connect()
    ctl = find_control(run)
    if ctl is None:
        _fail(f"no running run named {run!r} in this cluster (see `raytp status` for the runs it has)", 1)
    st = ray.get(ctl.get_status.remote(), timeout=30)
    if workers is not None:
        if workers % st["tp"]:
            _fail(f"--workers {workers} is not a multiple of the run's TP={st['tp']}; "
                  f"valid: {', '.join(str(st['tp'] * k) for k in range(1, 5))}, ...")
        tp, dp = st["tp"], workers // st["tp"]
    tp, dp = tp or st["tp"], dp or st["dp"]
    rid = ray.get(ctl.request.remote("scale", tp=tp, dp=dp), timeout=30)
    outcome = _await(ctl, rid, timeout, "scale")
    if not outcome.get("ok"):
        _fail(f"scale refused; the run goes on unchanged: {outcome.get('error')}", 1)
    click.echo(f"[raytp] {run} now runs at {outcome.get('layout')} (step {outcome.get('step', '?')})"
               + (f"; {outcome['bytes'] / 1e6:.1f} MB moved" if outcome.get("bytes") else ""))


if __name__ == "__main__":
    main()
