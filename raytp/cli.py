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
        path = Path(run_dir)
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
        summary = Driver(cfg, path, run, init_state=init_state).run_to_end(t_start=t0)
    except PlacementError as e:
        _fail(e, 1)
    except KeyboardInterrupt:
        click.echo(f"[raytp] interrupted; workers released, run dir {path} kept", err=True)
        sys.exit(130)
    finally:
        if embedded:
            ray.shutdown()
    val, loss = summary.get("val_loss"), summary.get("loss")
    click.echo(f"[raytp] finished {summary['steps']} steps in {summary['seconds']:.1f}s"
               + (f": loss {loss:.4f}" if loss is not None else "")
               + (f", val_loss {val:.4f}" if val is not None else "") + f"; run dir {path}", err=True)


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


def _connect(address: str | None) -> None:
    """Join the cluster a run lives on: --address, RAY_ADDRESS, or the local one `ray start` made."""
    import ray
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, namespace="raytp", log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError, ValueError) as e:
        _fail(f"cannot reach a Ray cluster at {address!r} ({type(e).__name__}: {str(e).splitlines()[0]}); "
              "pass --address or set RAY_ADDRESS", 1)


def _control_of(run: str):
    from raytp.runtime.control import find_control
    ctl = find_control(run)
    if ctl is None:
        _fail(f"no running run named {run!r} in this cluster (see `raytp status` for the runs it has)", 1)
    return ctl


def _format_status(st: dict) -> str:
    def num(key, fmt):
        return format(st[key], fmt) if st.get(key) is not None else "-"
    return (f"{st['run']}: {st['state']}  step {st.get('step', 0)}/{st.get('steps', '?')}  "
            f"TP={st.get('tp', '?')} x DP={st.get('dp', '?')} ({st.get('world_size', '?')} workers)  "
            f"loss {num('loss', '.4f')}  val {num('val_loss', '.4f')}  tok/s {num('tokens_per_s', ',.0f')}  "
            f"failures {st.get('failures', 0)}  dir {st.get('run_dir', '-')}")


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


@main.command()
@click.argument("run", required=False)
@click.option("--address", default=None, help="Ray cluster (default: RAY_ADDRESS, else the local one).")
def status(run, address):
    """Layout, step, loss, tokens/s and state of RUN (of every running run without RUN)."""
    import ray
    _connect(address)
    from raytp.runtime.control import find_control, list_runs
    runs = [run] if run else list_runs()
    if not runs:
        click.echo("no raytp runs are running in this cluster")
    for name in runs:
        ctl = find_control(name)
        if ctl is None:
            _fail(f"no running run named {name!r} in this cluster", 1)
        click.echo(_format_status(ray.get(ctl.get_status.remote(), timeout=30)))


@main.command()
@click.argument("run")
@click.option("--address", default=None, help="Ray cluster (default: RAY_ADDRESS, else the local one).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the run to stop.")
def stop(run, address, timeout):
    """Stop RUN at its next step boundary, with a checkpoint of the step it reached."""
    import ray
    _connect(address)
    ctl = _control_of(run)
    outcome = _await(ctl, ray.get(ctl.request.remote("stop"), timeout=30), timeout, "stop")
    click.echo(f"[raytp] {run} stopped" + (f" at step {outcome['step']}" if "step" in outcome else "")
               + (f"; checkpoint {outcome['checkpoint']}" if outcome.get("checkpoint") else ""))


@main.command()
@click.argument("run")
@click.option("--workers", type=int, default=None, help="Total workers; keeps TP and sets DP = workers / TP.")
@click.option("--tp", type=int, default=None, help="New tensor-parallel degree.")
@click.option("--dp", type=int, default=None, help="New data-parallel degree.")
@click.option("--address", default=None, help="Ray cluster (default: RAY_ADDRESS, else the local one).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the resize.")
def scale(run, workers, tp, dp, address, timeout):
    """Change RUN's layout while it trains: --workers N, or --tp N and/or --dp M."""
    import ray
    if workers is None and tp is None and dp is None:
        _fail("give --workers N, or --tp N and/or --dp M")
    if workers is not None and (tp is not None or dp is not None):
        _fail("--workers keeps TP and sets DP; give either it or --tp/--dp")
    _connect(address)
    ctl = _control_of(run)
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
