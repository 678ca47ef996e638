"""A job as `raytp.train` is given it, made into one that can run here, or BadJob before Ray starts.

The order is the command line's: the job and its overrides, the starting state (--resume, model.init_from),
the data against the model, the run directory, the memory of an embedded Ray's machine, the checkpoint
location. Every refusal is a BadJob whose message is what `raytp train` prints after ``error:``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

from raytp import names
from raytp.api.errors import BadJob
from raytp.config import ConfigError, JobConfig, adjusted, from_dict, load

JobSpec = Union[str, os.PathLike, Mapping[str, Any], JobConfig]
Overrides = Union[Mapping[str, Any], Sequence[str], None]


@dataclass(frozen=True)
class Plan:
    """A job ready to start: its config, name, run directory, starting state and memory estimate."""
    cfg: JobConfig
    run: str
    run_dir: Path
    init_state: tuple | None
    memory: Any  # raytp.runtime.estimate.WorkerMemory


def override_lines(overrides: Overrides) -> list[str]:
    """`--set` lines of `overrides`: "KEY=VALUE" strings as they are, a mapping's values written as JSON
    (which the job parser reads as YAML: 3e-4, true, null, [1, 2] and strings keep their types)."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    if isinstance(overrides, str):
        raise TypeError("overrides: a mapping or a list of 'KEY=VALUE' strings, not one string")
    return [str(item) for item in overrides]


def resume_spec(resume: bool | str | os.PathLike | None) -> str | None:
    """The command line's --resume: None (a fresh run), "latest" (this run's newest checkpoint), a location."""
    if resume is True:
        return "latest"
    return str(resume) if resume else None


def load_job(job: JobSpec, overrides: Overrides, say: Callable[[str], None]) -> JobConfig:
    """The job checked (BadJob: a line per problem), then adjusted where a short run needs it (`say` gets
    a ``warning:`` line per change)."""
    lines = override_lines(overrides)
    try:
        if isinstance(job, JobConfig):
            cfg = from_dict(job.to_dict(), "<JobConfig>", lines)
        elif isinstance(job, Mapping):
            cfg = from_dict(dict(job), "<dict>", lines)
        else:
            cfg = load(job, lines)
    except ConfigError as e:
        raise BadJob("\n".join(e.problems)) from None
    cfg, notes = adjusted(cfg)
    for note in notes:
        say(f"warning: {note}")
    return cfg


def run_name_and_dir(job: JobSpec, cfg: JobConfig, run_dir: str | os.PathLike | None,
                     name: str | None) -> tuple[str, Path]:
    """RUN is the last component of the run dir unless `name` (or the job's name) is given; the default
    run dir is runs/<name>, the default name <job file stem, or "job">-<local time>."""
    if run_dir:
        path = Path(run_dir).expanduser()
        return name or path.resolve().name, path
    stem = job if isinstance(job, (str, os.PathLike)) else "job"
    name = name or cfg.name or names.default_run_name(stem)
    return name, Path("runs") / name


def check_data(cfg: JobConfig) -> str:
    """The data sources exist, their token ids fit the model's vocabulary, and a document mask knows its id;
    returns what the data is (for the start line)."""
    from raytp.data.corpus import document_eod, job_corpus, packing_line, vocabulary_fits
    try:
        corpus = job_corpus(cfg.data, progress=True, peek=True)
        document_eod(cfg.data, corpus)
        vocabulary_fits(corpus, cfg.data, cfg.model.vocab_size)
        packed = packing_line(corpus, cfg.train.seed, cfg.model.block_size)  # conversations: rows, too long
    except ValueError as e:
        raise BadJob(str(e)) from None
    for split, streams in (("training", corpus.train), ("validation", corpus.val)):
        for stream in streams:  # (None where only peeked at: a dataset at a URL is sized by its manifest)
            if stream is not None and len(stream) <= cfg.model.block_size:
                raise BadJob(f"data: the {split} split of {corpus.description} holds {len(stream):,} tokens, "
                             f"fewer than model.block_size+1 = {cfg.model.block_size + 1}; give more data "
                             "or a smaller block_size" + (" or a larger data.val_fraction" if split == "validation"
                                                          and not cfg.data.val_source else ""))
    return corpus.description + packed


def check_storage(cfg: JobConfig, run_dir: Path, run: str) -> None:
    """The checkpoint location (and runtime.storage) is reachable and writable from here (the workers' side is
    checked once they are up)."""
    from raytp.files.storage import Storage, StorageError, check_writable, checkpoint_location
    for key, url in (("checkpoint.dir", checkpoint_location(cfg, run_dir, run)),
                     ("runtime.storage", cfg.runtime.storage)):
        try:
            if url:
                check_writable(Storage(url))
        except StorageError as e:
            raise BadJob(f"{key}: {e}") from None


def check_fresh(path: Path, resume: str | None) -> None:
    """The run directory holds no run, unless the run resumes its own (BadJob)."""
    if (path / "metrics.jsonl").exists() and resume != "latest":
        raise BadJob(f"run directory {path} already holds a run; pass --resume to continue it, "
                     "or another --run-dir/--name")


def plan(job: JobSpec, overrides: Overrides, run_dir, name: str | None, resume: str | None, embedded: bool,
         say: Callable[[str], None]) -> Plan:
    """Every check that needs no Ray, in the command line's order; `embedded`: every worker will run on
    this machine (its available memory is checked). Raises BadJob."""
    cfg = load_job(job, overrides, say)
    run, path = run_name_and_dir(job, cfg, run_dir, name)
    from raytp.files.checkpoint import CheckpointError
    from raytp.runtime.origin import starting_state
    try:
        cfg, init_state = starting_state(cfg, resume, path, say=lambda m: say(f"[raytp] {m}"), run=run)
    except (CheckpointError, ValueError) as e:
        raise BadJob(str(e)) from None
    except ConfigError as e:
        raise BadJob("\n".join(e.problems)) from None
    say(f"[raytp] data: {check_data(cfg)}")  # against the model the job trains (model.init_from's shape)
    from raytp.runtime import estimate
    memory = estimate.estimate(cfg)
    if embedded:
        problem = estimate.refusal(memory, cfg.world_size, estimate.available_here(), "this machine")
        if problem:
            raise BadJob(problem)
    check_storage(cfg, path, run)
    return Plan(cfg, run, path, init_state, memory)
