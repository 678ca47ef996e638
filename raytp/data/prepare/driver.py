"""`raytp prepare` from the driver's side: check the inputs, plan the shards, have them written (by Ray Data
tasks over every CPU of the cluster, or in this process), then write the manifest.

Before anything is written: the tokenizer and its end-of-document token are resolved, the sources expanded
(an empty one, or a file of an unknown format, is an error), each file's first records checked (CHECK_THREADS
at a time: an object store answers many requests at once), the shards planned, the output directory
opened (raytp.data.prepare.outdir). Then each shard is one Ray Data row: `map_batches` runs
shard.write_shard in a task of one CPU (the tokenizer's own threads off, so a node runs as many tasks as it
has CPUs), which returns its counts (or the error of its input, reported as one line). The manifest is
written once every shard is.

Why shards as rows rather than Ray Data's own readers (read_json, read_parquet): a shard's bytes must be a
function of the inputs alone (the same dataset on any cluster, a re-run that recognises its own output), and a
bad record must be named by file and line; Ray Data's blocks depend on the cluster and its readers drop line
numbers. Each task still streams its pieces (byte ranges, row groups) and never holds a whole file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from raytp.data import manifest as manifest_mod, tokens
from raytp.files.interop import chat_template
from raytp.data.prepare import inputs, outdir, plan, read, shard, tokenizer as tokenizer_mod
from raytp.files.storage import Storage

CHECK_THREADS = 16


@dataclass(frozen=True)
class Prepared:
    manifest: manifest_mod.Manifest
    fresh: bool                 # False: the dataset was there already (nothing to do)
    seconds: float              # encoding and writing, the checks before excluded
    node_tokens: dict = field(default_factory=dict)  # Ray node id -> tokens its tasks encoded

    @property
    def tokens_per_s(self) -> float:
        return self.manifest.tokens / self.seconds if self.seconds else 0.0


def _check_all(files, key: str) -> tuple[dict[int, tuple[int, ...]], str]:
    """Each Parquet file's row groups, and what the files' rows are (one kind for all: ValueError if not)."""
    with ThreadPoolExecutor(min(CHECK_THREADS, len(files))) as pool:
        heads = list(pool.map(lambda f: read.check_head(f, key), files))
    kinds = {k for _, k in heads}
    if len(kinds) > 1:
        conv = next(f.url for f, (_, k) in zip(files, heads) if k == read.CONVERSATIONS)
        text = next(f.url for f, (_, k) in zip(files, heads) if k == read.TEXT)
        raise ValueError(f"{conv} holds conversations and {text} texts; prepare them as two datasets")
    return {i: rg for i, (rg, _) in enumerate(heads) if rg}, kinds.pop()


QUIET = ("ray.data._internal.progress", "ray.data._internal.execution.streaming_executor")


@contextmanager
def _quiet_ray_data():
    """Ray Data without its progress bars and execution messages (ours count tokens), as it was after."""
    import ray
    ctx = ray.data.DataContext.get_current()
    saved = ctx.enable_progress_bars, ctx.print_on_execution_start, [logging.getLogger(n).level for n in QUIET]
    ctx.enable_progress_bars = ctx.print_on_execution_start = False
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        ctx.enable_progress_bars, ctx.print_on_execution_start = saved[:2]
        for name, level in zip(QUIET, saved[2]):
            logging.getLogger(name).setLevel(level)


def _ray_rows(shards: list, common: dict):
    """Each shard's counts as Ray Data tasks finish them (in the order they finish)."""
    import ray
    with _quiet_ray_data():
        ds = ray.data.from_items([{"index": i} for i in range(len(shards))], override_num_blocks=len(shards))
        ds = ds.map_batches(_encode_rows, batch_size=1, fn_kwargs={"shards": shards, "common": common},
                            num_cpus=1)
        yield from ds.iter_rows()


def _encode_rows(batch: dict, shards: list, common: dict) -> dict:
    """A Ray Data batch of shard indices -> their counts (and the node that encoded them)."""
    import ray
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one CPU per task: the cluster's CPUs are the parallelism
    rows = {"index": [], "documents": [], "tokens": [], "trained": [], "bad": [], "node": [], "error": []}
    node = ray.get_runtime_context().get_node_id()
    for i in batch["index"]:
        i = int(i)
        try:
            r, error = shard.write_shard(i, shards[i], **common), ""
        except ValueError as e:
            r, error = {"index": i, "documents": 0, "tokens": 0}, str(e)
        for k in ("index", "documents", "tokens"):
            rows[k].append(r[k])
        rows["trained"].append(r.get("trained", -1))
        rows["bad"].append(json.dumps(r.get("bad", {})))
        rows["node"].append(node)
        rows["error"].append(error)
    return rows


def _local_rows(shards: list, common: dict):
    for i, pieces in enumerate(shards):
        r = shard.write_shard(i, pieces, **common)
        yield {**r, "trained": r.get("trained", -1), "bad": json.dumps(r.get("bad", {})), "node": "local",
               "error": ""}


@contextmanager
def connected(address: str | None):
    """Ray: the connection this process has, else `address` (or RAY_ADDRESS) joined, else a local instance
    started for the run and stopped after it."""
    import ray
    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _chat_spec(tokenizer: str, named: str | None) -> dict:
    """The chat template conversations are rendered with, and its special tokens; ValueError if none."""
    path = tokens.tokenizer_file(tokenizer, "--tokenizer")
    template, where = chat_template.find_template(path, named)
    if template is None:
        raise ValueError(f"--tokenizer: {path.parent} has no chat template (no chat_template.jinja, no "
                         "chat_template in tokenizer_config.json) for these conversations; name one with "
                         "--chat-template FILE")
    spec = chat_template.chat_spec(path, template)
    spec["sha256"] = hashlib.sha256(template.encode()).hexdigest()
    spec["source"] = where
    return spec


def run(sources: list[str], tokenizer: str, out: str, text_key: str = "text", eod: str | None = None,
        shard_tokens: int | None = None, overwrite: bool = False, progress: bool = True,
        address: str | None = None, local: bool = False, chat_template: str | None = None) -> Prepared:
    """Prepare `sources` into a dataset at `out` (see raytp.data.prepare); ValueError (one line naming the
    file, key or option) for bad input, before anything is written where that can be checked. Files of
    conversations (known by their rows) are rendered with the tokenizer's chat template, or `chat_template`."""
    tok = tokenizer_mod.resolve(tokenizer, eod)
    sources = [str(s) for s in sources]
    files = inputs.expand_all(sources)
    if not any(f.size for f in files):
        raise ValueError(f"{', '.join(sources)}: an empty source (its files hold no bytes)")
    shard_tokens = shard_tokens or plan.shard_size(files)
    row_groups, kind = _check_all(files, text_key)
    shards = plan.plan(files, shard_tokens, row_groups)
    if chat_template and kind == read.TEXT:
        raise ValueError(f"--chat-template: {', '.join(sources)} hold texts, not conversations (rows of 'messages', "
                         "or 'prompt' and 'completion'); drop it")
    spec = _chat_spec(tokenizer, chat_template) if kind == read.CONVERSATIONS else None
    store = Storage(out)
    fp = plan.fingerprint(files, tok.sha256, tok.eod_id, text_key, shard_tokens, spec and spec["sha256"])
    if outdir.open_out(store, fp, sources, overwrite) == outdir.DONE:
        return Prepared(outdir.existing(store), fresh=False, seconds=0.0)
    dtype = manifest_mod.dtype_for(tok.vocab_size)
    common = {"files": files, "tok_json": tok.json, "tok_sha": tok.sha256, "eod_id": tok.eod_id,
            "dtype": dtype, "out": store.url, "key": text_key, "chat_spec": spec}
    from tqdm import tqdm
    counts, nodes, bad = {}, Counter(), Counter()
    with nullcontext() if local else connected(address):
        start = time.perf_counter()
        bar = tqdm(unit="tok", unit_scale=True, desc="[raytp] prepare", file=sys.stderr, disable=not progress,
                   postfix=f"shards 0/{len(shards)}")
        rows = (_local_rows if local else _ray_rows)(shards, common)
        try:
            for row in rows:
                if row["error"]:
                    raise ValueError(row["error"])
                counts[int(row["index"])] = (int(row["documents"]), int(row["tokens"]),
                                             None if int(row["trained"]) < 0 else int(row["trained"]))
                bad.update(json.loads(row["bad"]))
                nodes[row["node"]] += int(row["tokens"])
                bar.update(int(row["tokens"]))
                bar.set_postfix_str(f"shards {len(counts)}/{len(shards)}", refresh=False)
        finally:
            rows.close()  # on an error: Ray Data stops, no task goes on writing
            bar.close()
        seconds = time.perf_counter() - start
    for i in range(len(shards)):
        if counts[i][0] == 0:  # a range of a file where no line starts: not a shard (a reader cannot map it)
            for suffix in (".bin", ".idx", shard.MASK):
                store.remove(shard.prefix(i) + suffix)
    kept = tuple(manifest_mod.Shard(shard.prefix(i), *counts[i]) for i in range(len(shards)) if counts[i][0])
    conv = None
    if spec is not None:
        conv = {"rows": sum(s.documents for s in kept) + sum(bad.values()),
                "trained_tokens": sum(s.trained for s in kept), "bad": dict(sorted(bad.items())),
                "chat_template": {"sha256": spec["sha256"], "source": spec["source"]}}
    m = manifest_mod.Manifest(tok.manifest_entry(), dtype, kept, tuple(sources), conv)
    if not m.shards:
        raise ValueError(f"{', '.join(sources)}: an empty source (no documents in its files)")
    outdir.finish(store, m)
    return Prepared(m, fresh=True, seconds=seconds, node_tokens=dict(nodes))
