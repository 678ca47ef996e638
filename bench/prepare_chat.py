"""prepare_chat: `raytp prepare` on conversations, conversations/s against transformers' apply_chat_template on
the same tokenizer and rows, as a ratio in one run.

The rows: raytp.data.chat_demo's conversations (ROWS, QUICK_ROWS with --quick: one to three turns, a system
turn sometimes, some prompt/completion), as one JSON-lines file, and its tokenizer (Qwen3's chat template).

- raytp: `raytp.data.prepare` on a fresh local Ray of CPUS CPUs: reading the rows, rendering each with the
  template, finding the trained tokens (a render per assistant turn more), encoding, writing the shards, their
  masks and the manifest; timed from the first task to the manifest, as bench/prepare does;
- peer: `datasets.Dataset.map(num_proc=CPUS)` calling `apply_chat_template(tokenize=True)` on each row when
  `datasets` is installed (from the JSON lines to its Arrow cache); else CPUS fresh processes, each calling
  it on its share of the rows already in memory (what datasets' workers run, without its reading and writing:
  a faster peer). Either renders and encodes; neither finds what to train on.

Each is measured ROUNDS times, interleaved; the best of each and the median of the paired ratios reported.
And the work alone, in this process on rows in memory (`one_process`): raytp's encoding against
apply_chat_template(tokenize=True), one row at a time (a quarter of the rows).
Ray Data's own start on a fresh Ray (the same pipeline importing what a task imports, transformers among it)
is measured apart, for what it is: paid once a prepare, it weighs on a run of 20,000 short conversations.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

CPUS = 2
ROWS, QUICK_ROWS = 20000, 2000
ROUNDS = 3


def _messages(row: dict) -> list:
    if row.get("messages") is not None:  # (datasets gives every row every column: None where a row has none)
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]


def _peer_part(tok_dir: str, rows: list, start, out) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    start.wait()
    t0 = time.perf_counter()
    tokens = sum(len(tok.apply_chat_template(_messages(r), tokenize=True)) for r in rows)
    out.put((tokens, time.perf_counter() - t0))


def peer_processes(tok_dir: str, rows: list) -> float:
    """Conversations/s of CPUS fresh processes, each applying the template to its share."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_peer_part, args=(tok_dir, rows[k::CPUS], start, out)) for k in range(CPUS)]
    for p in procs:
        p.start()
    time.sleep(5.0)  # their imports and tokenizers loaded before the start
    start.set()
    parts = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return len(rows) / max(s for _, s in parts)


def peer_datasets(tok_dir: str, corpus: Path, cache: Path) -> float:
    import datasets
    from transformers import AutoTokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = AutoTokenizer.from_pretrained(tok_dir)
    start = time.perf_counter()
    ds = datasets.Dataset.from_json(str(corpus), cache_dir=str(cache))
    out = ds.map(lambda r: {"ids": tok.apply_chat_template(_messages(r), tokenize=True)}, num_proc=CPUS)
    return len(out) / (time.perf_counter() - start)


def raytp_rate(tok_dir: str, corpus: Path, out: Path, rows: int) -> tuple[float, dict]:
    import ray
    from raytp.data.prepare.driver import run
    ray.init(address="local", num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
    try:
        r = run([str(corpus)], tok_dir, str(out), shard_tokens=max(rows * 80 // (4 * CPUS), 1000), progress=False)
    finally:
        ray.shutdown()
    return r.manifest.documents / r.seconds, r.manifest.conversations


def cold_start_s(shards: int) -> float:
    """What Ray Data costs before a prepare's first conversation on a fresh local Ray: the same pipeline doing
    nothing but import what a task rendering conversations imports (transformers with it)."""
    from bench.prepare import cold_start_s as start_of
    return start_of(shards, ("raytp.data.prepare.shard", "transformers.tokenization_utils_fast"))


def one_process(tok_dir: str, rows: list) -> dict:
    """Conversations/s in this process, rows in memory: raytp's encoding (render, find the trained tokens,
    encode; batches of BATCH_ROWS) and transformers' apply_chat_template(tokenize=True) one row at a time:
    the work alone, without Ray Data, reading or writing."""
    from transformers import AutoTokenizer
    from raytp.data.prepare import chat
    from raytp.data.prepare.shard import BATCH_ROWS
    from raytp.data.tokens import tokenizer_file
    from raytp.files.interop.chat_template import chat_spec, find_template
    path = tokenizer_file(tok_dir)
    renderer = chat.renderer(path.read_text(), chat_spec(path, find_template(path)[0]))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    t0 = time.perf_counter()
    for i in range(0, len(rows), BATCH_ROWS):
        chat.encode(renderer, rows[i:i + BATCH_ROWS])
    ours = len(rows) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for r in rows:
        tok.apply_chat_template(_messages(r), tokenize=True)
    return {"raytp": round(ours), "peer": round(len(rows) / (time.perf_counter() - t0))}


def run(quick: bool = False) -> dict:
    from raytp.data.chat_demo import conversations, tokenizer_dir, write_jsonl
    import importlib.util
    have_datasets = importlib.util.find_spec("datasets") is not None
    if have_datasets:
        peer_name = f"datasets.Dataset.map(num_proc={CPUS}) calling apply_chat_template(tokenize=True)"
    else:
        peer_name = (f"{CPUS} processes calling transformers' apply_chat_template(tokenize=True) on rows in memory "
                     "(`datasets` is not installed: its workers' work without its reading and writing)")
    n = QUICK_ROWS if quick else ROWS
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-chat-") as tmp:
        tmp = Path(tmp)
        tok_dir = tokenizer_dir(tmp / "tok")
        rows = conversations(n, seed=1)
        corpus = Path(write_jsonl(tmp / "rows.jsonl", rows))
        for r in range(1 if quick else ROUNDS):
            ours, counts = raytp_rate(tok_dir, corpus, tmp / f"out{r}", n)
            theirs = (peer_datasets(tok_dir, corpus, tmp / f"hf{r}") if have_datasets
                      else peer_processes(tok_dir, rows))
            rounds.append({"raytp": ours, "peer": theirs})
            rounds[-1].update({f"one_process_{k}": v for k, v in one_process(tok_dir, rows[:n // 4]).items()})
        cold = cold_start_s(4 * CPUS)
    best = {k: max(r[k] for r in rounds) for k in ("raytp", "peer", "one_process_raytp", "one_process_peer")}
    return {
        "peer": peer_name, "rows": n, "cpus": CPUS, "rounds": len(rounds),
        "trained_tokens_per_conversation": round(counts["trained_tokens"] / n, 1),
        "conversations_per_s": {k: round(best[k]) for k in ("raytp", "peer")},
        "raytp_vs_peer": round(best["raytp"] / best["peer"], 3),
        "one_process_conversations_per_s": {k: round(best[f"one_process_{k}"]) for k in ("raytp", "peer")},
        "one_process_raytp_vs_peer": round(statistics.median(r["one_process_raytp"] / r["one_process_peer"]
                                                             for r in rounds), 3),
        "raytp_vs_peer_paired_median": round(statistics.median(r["raytp"] / r["peer"] for r in rounds), 3),
        "ray_data_cold_start_s": round(cold, 2),  # apart, after the rounds: no rate is derived from it
        "rounds_conversations_per_s": [{k: round(v) for k, v in r.items()} for r in rounds],
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "bad_rows": json.dumps(counts["bad"]),
    }
