"""Commands that run here: train a job (an embedded Ray, or a cluster it joins), export, sample.

    raytp train jobs/default.yaml --set parallel.tp=4
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from raytp import config as config_mod
from raytp import names
from raytp.cli.base import EXIT_BAD_CONFIG, EXIT_FAILED, check_data, fail, failed, keys_help, load_job, main


def run_name_and_dir(job: str, cfg: config_mod.JobConfig, run_dir: str | None, name: str | None) -> tuple[str, Path]:
    """RUN is the last component of the run dir unless --name (or the job's name) is given."""
    if run_dir:
        path = Path(run_dir).expanduser()
        return name or path.resolve().name, path
    name = name or cfg.name or names.default_run_name(job)
    return name, Path("runs") / name


def check_storage(cfg: config_mod.JobConfig, run_dir: Path) -> None:
    """The checkpoint location must be reachable and writable from here, before Ray starts (the workers'
    side is checked once they are up)."""
    from raytp.files.storage import Storage, StorageError, check_writable
    try:
        check_writable(Storage(cfg.checkpoint.dir or str(run_dir / "checkpoints")))
    except StorageError as e:
        fail(f"checkpoint.dir: {e}")


def check_cluster_memory(cfg: config_mod.JobConfig, memory) -> None:
    """A joined cluster: some alive node must hold one TP group's workers (exit 2 before any placement)."""
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
        ray.shutdown()
        fail(problem)


def connect_ray(address: str | None, cfg: config_mod.JobConfig) -> bool:
    """Join the cluster at `address` (or RAY_ADDRESS), else start an embedded local one. True if embedded."""
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
        return False
    # A fresh local instance, deliberately ("local" never joins a stale cluster).
    needed = cfg.world_size * cfg.runtime.cpus_per_worker
    ray.init(address="local", namespace=names.NAMESPACE, num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)),
             include_dashboard=False, log_to_driver=True)
    return True


@main.command(epilog=keys_help())
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
    cfg = load_job(job, sets)
    run, path = run_name_and_dir(job, cfg, run_dir, name)
    from raytp.runtime.origin import starting_state
    from raytp.files.checkpoint import CheckpointError
    try:
        cfg, init_state = starting_state(cfg, resume, path, say=lambda m: click.echo(f"[raytp] {m}", err=True))
    except (CheckpointError, ValueError) as e:
        fail(e)
    except config_mod.ConfigError as e:
        fail("\n".join(e.problems))
    check_data(cfg)  # against the model the job trains (model.init_from's shape, when given)
    if (path / "metrics.jsonl").exists() and resume != "latest":
        fail(f"run directory {path} already holds a run; pass --resume to continue it, or another --run-dir/--name")
    from raytp.runtime import estimate, policy
    memory = estimate.estimate(cfg)
    if not address and not os.environ.get("RAY_ADDRESS"):  # an embedded Ray: every worker on this machine
        problem = estimate.refusal(memory, cfg.world_size, estimate.available_here(), "this machine")
        if problem:
            fail(problem)
    check_storage(cfg, path)
    path.mkdir(parents=True, exist_ok=True)
    import yaml
    (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    click.echo(f"[raytp] run {run}  dir {path}  layout {policy.layout_of(cfg)}  "
               f"device {cfg.runtime.device}  memory {memory.line()}", err=True)

    embedded = connect_ray(address, cfg)
    if not embedded:
        check_cluster_memory(cfg, memory)
    import ray
    from raytp.runtime.driver.driver import Driver
    from raytp.files.storage import StorageError
    try:
        driver = Driver(cfg, path, run, init_state=init_state)
        _stop_on_sigterm(driver)
        summary = driver.run_to_end(t_start=t0)
    except KeyboardInterrupt:
        click.echo(f"[raytp] interrupted; workers released, run dir {path} kept", err=True)
        sys.exit(130)
    except StorageError as e:  # the location is not one every worker reaches: a bad job
        failed(e, EXIT_BAD_CONFIG)
    except Exception as e:  # noqa: BLE001 - one line (and the run dir's events.jsonl) say what failed
        failed(e, EXIT_FAILED)
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
@click.argument("source")
@click.option("--out", required=True, type=click.Path(), help="Output file (raytp) or directory (hf).")
@click.option("--format", "fmt", type=click.Choice(["raytp", "hf"]), default="raytp", show_default=True,
              help="raytp: one file raytp.models.files.load_model reads; hf: a GPT-2 or Llama directory for transformers.")
@click.option("--tokenizer", default=None, type=click.Path(exists=True),
              help="tokenizer.json (or a directory holding one) to ship with the model; default: the run's "
                   "data.tokenizer when SOURCE is a run dir.")
def export(source, out, fmt, tokenizer):
    """Write one unsharded model from SOURCE (a run dir, a checkpoint dir, or a URL of either), tensor by tensor."""
    from raytp.files import checkpoint
    from raytp.train.tokens import tokenizer_file
    try:
        tok = tokenizer_file(tokenizer, "--tokenizer") if tokenizer else None
        if tok is None and (spec := _run_tokenizer(source)):
            tok = tokenizer_file(spec)
        ckpt = checkpoint.find(source, warn=lambda m: click.echo(f"[raytp] warning: {m}", err=True))
        if fmt == "hf":
            from raytp.files import hf
            hf.save(ckpt, Path(out))
            if tok is not None:
                import shutil
                shutil.copyfile(tok, Path(out) / "tokenizer.json")
        else:
            from raytp.files.export import write_model
            write_model(ckpt, Path(out), tok)
    except checkpoint.CheckpointError as e:
        fail(e, 1)
    except ValueError as e:
        fail(str(e), 2)
    click.echo(f"[raytp] exported step {ckpt.step} of {ckpt.where} ({fmt}) to {out}", err=True)


def _run_tokenizer(source: str) -> str | None:
    """data.tokenizer of the run whose run dir is `source`, if it is one and names a tokenizer."""
    job = Path(source) / "config.yaml"
    if not job.is_file():
        return None
    import yaml
    try:
        tok = ((yaml.safe_load(job.read_text()) or {}).get("data") or {}).get("tokenizer")
    except yaml.YAMLError:
        return None
    return tok if isinstance(tok, str) else None


@main.command()
@click.argument("model_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompt", default="\n", show_default=True, help="Text to continue.")
@click.option("--tokens", default=200, show_default=True, help="Tokens to generate.")
@click.option("--temperature", default=0.8, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=None, type=int, help="Sample among the k likeliest tokens only.")
@click.option("--seed", default=0, show_default=True)
@click.option("--tokenizer", default=None, type=click.Path(exists=True),
              help="tokenizer.json (or a directory holding one); default: the one the file carries, else bytes.")
def sample(model_file, prompt, tokens, temperature, top_k, seed, tokenizer):
    """Generate text from MODEL_FILE (written by `raytp export`), encoded and decoded with its tokenizer."""
    import torch
    from raytp.models.files import load_model
    from raytp.train import tokens as tok_mod
    from raytp.files.export import embedded_tokenizer
    try:
        model = load_model(model_file)
    except ValueError as e:
        fail(e, 1)
    try:
        tok = tok_mod.load(tokenizer, "--tokenizer") if tokenizer else None
    except ValueError as e:
        fail(str(e), 2)  # a bad argument, as export's
    if tok is None and (text := embedded_tokenizer(model_file)) is not None:
        tok = tok_mod.from_json(text)
    if tok is None and model.cfg.vocab_size > 256:
        fail(f"{model_file}: vocabulary of {model.cfg.vocab_size} is not byte level and the file carries no "
             "tokenizer; pass --tokenizer", 1)
    ids = tok.encode(prompt, add_special_tokens=False).ids if tok is not None else list(prompt.encode())
    g = torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([ids], dtype=torch.long), tokens, temperature=temperature, top_k=top_k,
                         generator=g)[0].tolist()
    click.echo(tok.decode(out) if tok is not None else bytes(out).decode("utf-8", errors="replace"))
