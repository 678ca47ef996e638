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
    """A job ready to start: its config, name, run directory, starting state and memory estimate, and the
    run's id (its mark on the checkpoints it writes: raytp.files.checkpoint_owner)."""
    cfg: JobConfig
    run: str
    run_dir: Path
    init_state: tuple | None
    memory: Any  # raytp.runtime.estimate.WorkerMemory
    run_id: str = ""


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
    run dir is runs/<name>, the default name <job file stem, or "job">-<local time>. Every name is checked
    as `submit` and the job's `name` key check theirs, before anything is written (BadJob)."""
    from raytp.trust import Untrusted, check_path
    if run_dir:
        try:
            check_path(run_dir, "--run-dir")
        except Untrusted as e:
            raise BadJob(str(e)) from None
        path = Path(run_dir).expanduser()
        run = name or path.resolve().name
        what = "--name" if name else f"--run-dir {str(run_dir)[:80]}: its last component, the run name,"
    else:
        stem = job if isinstance(job, (str, os.PathLike)) else "job"
        run = name or cfg.name or names.default_run_name(stem)
        what, path = ("--name" if name else "run name"), Path("runs") / run
    problem = names.check_run_name(run, what)
    if problem:
        raise BadJob(problem + ("; pass --name" if what.startswith("--run-dir") else ""))
    return run, path


def check_data(cfg: JobConfig) -> tuple[str, bool]:
    """The data sources exist, their token ids fit the model's vocabulary, and a document mask knows its id;
    returns what the data is (for the start line) and whether it is a dataset of conversations (packed: the
    attention kept inside each, as by data.document_mask)."""
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
    return corpus.description + packed, bool(corpus.conversations)


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


def check_owned(cfg: JobConfig, path: Path, run: str, resume: str | None) -> None:
    """A fresh run writes over nobody's files: its run dir holds no other run's (a config.yaml of another
    job, checkpoints) and its checkpoint location no checkpoint of another run (BadJob); a resumed run
    continues what is there, and prunes only what it marked."""
    import yaml
    from raytp.files.checkpoint_owner import foreign
    from raytp.files.storage import Storage, checkpoint_location
    if resume is not None:
        return
    old, ours = path / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode()
    if old.is_file() and _head(old, len(ours) + 1) != ours:
        raise BadJob(f"run directory {path} holds another run's files (its config.yaml is another job's); pass "
                     "--resume to continue that run, or another --run-dir/--name")
    location = checkpoint_location(cfg, path, run)
    try:
        others = foreign(Storage(location), None)
    except Exception:  # noqa: BLE001 - unreachable, no credentials: check_storage says why
        return
    if others:
        raise BadJob(f"checkpoint location {location} holds checkpoints this run did not write "
                     f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); pass --resume to continue "
                     "from them, or give this run a location of its own (checkpoint.dir, --run-dir)")


def _head(path: Path, n: int) -> bytes:
    """At most the first `n` bytes of a file (one in a run dir may be anything)."""
    with open(path, "rb") as f:
        return f.read(n)


def run_id_for(path: Path, resume: str | None, init_state) -> str:
    """The run's id: its run dir's, when it resumes; else that of the checkpoint a bare --resume continues;
    else a new one."""
    from raytp.files.checkpoint_owner import new_run_id, read_run_id
    own = read_run_id(path) if resume is not None else None
    if own is None and resume == "latest" and init_state is not None:
        marked = getattr(init_state[1], "manifest", {}).get("run_id")
        own = marked if isinstance(marked, str) else None
    return own or new_run_id()


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
    check_fresh(path, resume)  # a run there already: its own message first
    check_owned(cfg, path, run, resume)
    try:  # a size no model of this world has is refused before anything is built (the estimate builds one)
        from raytp.config.adapters import model_args
        from raytp.trust import check_model_size
        check_model_size(model_args(cfg), "model")
    except ValueError as e:
        raise BadJob(str(e)) from None
    line, conversations = check_data(cfg)  # against the model the job trains (model.init_from's shape)
    say(f"[raytp] data: {line}")
    from raytp.runtime import estimate
    memory = estimate.estimate(cfg, documents=conversations)
    if embedded:
        problem = estimate.refusal(memory, cfg.world_size, estimate.available_here(), "this machine")
        if problem:
            raise BadJob(problem)
    check_storage(cfg, path, run)
    return Plan(cfg, run, path, init_state, memory, run_id_for(path, resume, init_state))
