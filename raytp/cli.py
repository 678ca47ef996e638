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


@main.command(epilog=_keys_help())
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a job key, e.g. --set parallel.tp=4 (repeatable; beats the file).")
@click.option("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray).")
@click.option("--run-dir", default=None, help="Run directory (default: runs/<name>).")
@click.option("--name", default=None, help="Run name (default: the run directory's last component).")
def train(job, sets, address, run_dir, name):
    """Train the model of JOB (a YAML job file) on a Ray cluster."""
    t0 = time.perf_counter()
    cfg = _load_job(job, sets)
    _check_data(cfg)
    run, path = run_name_and_dir(job, cfg, run_dir, name)
    if (path / "metrics.jsonl").exists():
        click.echo(f"error: run directory {path} already holds a run; pass another --run-dir or --name", err=True)
        sys.exit(EXIT_BAD_CONFIG)
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
        summary = Driver(cfg, path, run).run_to_end(t_start=t0)
    except PlacementError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo(f"[raytp] interrupted; workers released, run dir {path} kept", err=True)
        sys.exit(130)
    finally:
        if embedded:
            ray.shutdown()
    val = summary.get("val_loss")
    click.echo(f"[raytp] finished {summary['steps']} steps in {summary['seconds']:.1f}s: loss {summary['loss']:.4f}"
               + (f", val_loss {val:.4f}" if val is not None else "") + f"; run dir {path}", err=True)


if __name__ == "__main__":
    main()
