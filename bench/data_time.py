"""data_time: what building each step's batch costs (`data_s` in metrics.jsonl) against the step itself.

Issue 21's goal: data_s <= 1% of the step time, for ``jobs/default.yaml`` and for a job of a 1M-token global
batch. Both run through ``raytp train`` on the local Ray (2 cores, gloo), reading a raytp prepared dataset
(written here from the format: shards of uint16 ids, documents ended by an end-of-document id) rather than the
builtin text, so the batches come from memory-mapped shards through the epoch permutation. The 1M-token job is
a small model (its step is short, which makes the ratio harder, not easier) at global batch 2048 x 512
tokens, DP = 2 (each rank builds 512k tokens). Figures: the median over the steps after the first of data_s,
step_time_s and their ratio; and the batch time of the 1M-token batch at DP = 1 measured in-process
(raytp.data.corpus.batch, no Ray), the most one rank ever builds.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from raytp.data import manifest as mf
from raytp.data.indexed import write_indexed

ROOT = Path(__file__).resolve().parents[1]
PEER = "the training step itself (data_s / step_time_s from the same run's metrics.jsonl; goal <= 1%)"
EOD = 255


def write_dataset(root: Path, tokens: int, shards: int = 4) -> str:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    listed = []
    for s in range(shards):
        docs, have = [], 0
        while have < tokens // shards:
            d = np.append(rng.integers(0, EOD, int(rng.integers(200, 4000))), EOD)
            docs.append(d)
            have += len(d)
        write_indexed(root / f"shard-{s:05d}", docs, np.uint16)
        listed.append(mf.Shard(f"shard-{s:05d}", len(docs), have))
    m = mf.Manifest({"sha256": "bench", "vocab_size": 256, "eod_id": EOD, "eod_token": "<eod>"}, "uint16",
                    tuple(listed), ("bench/data_time",))
    (root / mf.NAME).write_text(m.to_json())
    return str(root)


def _train(run_dir: Path, job: str, sets: list[str]) -> dict:
    args = [sys.executable, "-m", "raytp.cli", "train", job, "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"raytp train failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][1:]  # the first step warms up
    data = statistics.median(r["data_s"] for r in records)
    step = statistics.median(r["step_time_s"] for r in records)
    return {"median_data_s": round(data, 6), "median_step_time_s": round(step, 4),
            "data_over_step": round(data / step, 5), "steps_timed": len(records)}


def _in_process(source: str, batch: int, block: int) -> float:
    from raytp.data.corpus import batch as make_batch, load_corpus
    corpus = load_corpus(source, 0.01)
    make_batch(corpus, "train", 1, 0, 0, 1, batch, block)  # pages in
    times = []
    for step in range(1, 6):
        t0 = time.perf_counter()
        make_batch(corpus, "train", 1, step, 0, 1, batch, block)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(quick: bool = False) -> dict:
    batch, block, steps = (64, 128, 3) if quick else (2048, 512, 4)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = write_dataset(tmp / "data", 2_000_000 if quick else 64_000_000)
        default = _train(tmp / "default", "jobs/default.yaml",
                         [f"data.source={source}", f"train.steps={6 if quick else 40}", "checkpoint.every=0",
                          "train.eval_interval=0"])
        big = _train(tmp / "big", "jobs/default.yaml",
                     [f"data.source={source}", f"train.steps={steps}", "checkpoint.every=0", "train.eval_interval=0",
                      "parallel.tp=1", "parallel.dp=2", f"train.batch_size={batch}", "train.micro_batch_size=16",
                      f"model.block_size={block}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                      "train.steps_per_call=1"])
        whole = _in_process(source, batch, block)
    return {"peer": PEER, "quick": quick, "cpu_cores": 2,
            "default_job": default,
            f"batch_{batch * block}_tokens_dp2": big,
            f"batch_{batch * block}_tokens_dp1_in_process_s": round(whole, 5),
            "goal": "data_over_step <= 0.01"}
