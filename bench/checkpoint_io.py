"""checkpoint_io: raytp's sharded checkpoints vs a plain torch.save/torch.load of the same state.

A GPT (8 layers x 512 wide, ~25M parameters) and its AdamW state after one
step (so exp_avg/exp_avg_sq exist): ~0.3 GB in float32. Its full one-device
state (``checkpoint.shard_state`` of the whole model) is sliced into TP=4
shards with ``checkpoint.slice_state``, as four workers would hand them to the
driver. Measured, 5 repetitions (a few seconds each) with the order of raytp
and the peer swapped each time, medians reported:

- save: ``checkpoint.save`` of the 4 shards (4 files, each fsynced, manifest,
  atomic rename) vs ``torch.save`` of the full state to one file; the peer's
  fsync of that file is timed separately and reported too (raytp's save is
  durable, plain torch.save is not).
- load: ``checkpoint.load`` (validates, reads the 4 shards, unshards to the
  full state, i.e. reshard-on-load to TP=1) vs ``torch.load(weights_only=True)``.
- reshard TP=4 -> TP=2: ``checkpoint.load`` plus ``slice_state`` for both TP=2
  ranks vs the same plain ``torch.load``.

Files are written to a temporary directory on the system disk (the same for
both) and read back from it soon after, so reads are usually served by the
page cache for both alike (dropping caches needs root). Seconds per GB use each
side's bytes on disk.

One torch thread: on a shared 2-core machine, 2 intra-op threads made
checkpoint.load's ~600 small parallel copies (torch.cat/clone) stall whenever
another process held a core (2-8 s instead of 0.4 s for the same load), while
torch.load, which does no parallel ops, was unaffected; one thread is stable.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from raytp.model import GPT, GPTConfig
from raytp.train import checkpoint
from raytp.train.step import Hyper, make_optimizer

PEER = "torch.save / torch.load(weights_only=True) of the same full (unsharded) model+AdamW state, one file"
FULL = {"cfg": GPTConfig(n_layer=8, n_head=8, n_embd=512, block_size=256, vocab_size=256, dropout=0.0), "reps": 5}
QUICK = {"cfg": GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256, dropout=0.0), "reps": 2}
TP_SAVED, TP_LOADED = 4, 2
THREADS = 1  # see the module doc
GB = 1e9


def full_state(cfg: GPTConfig) -> dict:
    """shard_state of the whole model and its AdamW after one optimizer step."""
    torch.manual_seed(1337)
    model = GPT(cfg)
    opt = make_optimizer(model, Hyper(lr=1e-3, weight_decay=0.1))
    x = torch.randint(0, cfg.vocab_size, (2, min(64, cfg.block_size)))
    loss = model(x, torch.roll(x, -1, 1))
    loss.backward()
    opt.step()
    return checkpoint.shard_state(model, opt)


def nbytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for part in state.values() for t in part.values()
               for v in (t.values() if isinstance(t, dict) else [t]))


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _same(a: dict, b: dict) -> bool:
    return a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][n], b["model"][n])
                                                           for n in a["model"])


def run(quick: bool = False) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return measure(QUICK if quick else FULL)
    finally:
        torch.set_num_threads(threads)


def measure(p: dict) -> dict:
    cfg = p["cfg"]
    full = full_state(cfg)
    shards = [checkpoint.slice_state(full, r, TP_SAVED) for r in range(TP_SAVED)]
    t: dict[str, list[float]] = {k: [] for k in ("raytp_save", "torch_save", "torch_fsync", "raytp_load",
                                                  "torch_load", "raytp_reshard_4to2")}
    sizes = {}
    tmp = Path(tempfile.mkdtemp(prefix="raytp-bench-ckpt-"))
    try:
        for rep in range(p["reps"]):
            d = tmp / f"rep{rep}"
            d.mkdir()
            plain = d / "full.pt"

            def raytp_save():
                sec, path = timed(lambda: checkpoint.save(d / "ckpt", rep, shards, cfg, TP_SAVED, 1, keep=1))
                t["raytp_save"].append(sec)
                sizes["raytp"] = sum(f.stat().st_size for f in path.iterdir())
                return path

            def torch_save():
                t["torch_save"].append(timed(lambda: torch.save(full, plain))[0])
                t["torch_fsync"].append(timed(lambda: checkpoint.fsync_path(plain))[0])
                sizes["torch"] = plain.stat().st_size

            def raytp_load():
                sec, (_, loaded) = timed(lambda: checkpoint.load(ckpt_dir))
                t["raytp_load"].append(sec)
                assert _same(loaded, full), "checkpoint.load did not give back the saved state"

            def torch_load():
                sec, loaded = timed(lambda: torch.load(plain, map_location="cpu", weights_only=True))
                t["torch_load"].append(sec)
                assert _same(loaded, full)

            def reshard():
                def go():
                    _, loaded = checkpoint.load(ckpt_dir)
                    return [checkpoint.slice_state(loaded, r, TP_LOADED) for r in range(TP_LOADED)]
                sec, two = timed(go)
                t["raytp_reshard_4to2"].append(sec)
                assert _same(two[1], checkpoint.slice_state(full, 1, TP_LOADED))

            first = rep % 2 == 0  # raytp first on even repetitions, the peer first on odd ones
            if first:
                ckpt_dir = raytp_save()
                torch_save()
            else:
                torch_save()
                ckpt_dir = raytp_save()
            for fn in ((raytp_load, torch_load, reshard) if first else (torch_load, reshard, raytp_load)):
                fn()
            shutil.rmtree(d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in t.items()}
    n_params = sum(v.numel() for v in full["model"].values())
    fig: dict = {
        "peer": PEER,
        "model": f"GPT {cfg.n_layer}L x {cfg.n_embd} wide, {n_params / 1e6:.1f}M params, AdamW state, float32",
        "state_gb": round(nbytes(full) / GB, 3),
        "raytp_files_gb": round(sizes["raytp"] / GB, 3),
        "torch_file_gb": round(sizes["torch"] / GB, 3),
        "repetitions": p["reps"],
        "torch_threads": THREADS,
        "save_raytp_s_per_gb": round(med["raytp_save"] / (sizes["raytp"] / GB), 3),
        "save_torch_s_per_gb": round(med["torch_save"] / (sizes["torch"] / GB), 3),
        "save_torch_plus_fsync_s_per_gb": round((med["torch_save"] + med["torch_fsync"]) / (sizes["torch"] / GB), 3),
        "save_ratio_raytp_to_torch": round(med["raytp_save"] / med["torch_save"], 3),
        "save_ratio_raytp_to_torch_plus_fsync": round(med["raytp_save"] / (med["torch_save"] + med["torch_fsync"]), 3),
        "load_raytp_s_per_gb": round(med["raytp_load"] / (sizes["raytp"] / GB), 3),
        "load_torch_s_per_gb": round(med["torch_load"] / (sizes["torch"] / GB), 3),
        "load_ratio_raytp_to_torch": round(med["raytp_load"] / med["torch_load"], 3),
        "reshard_4to2_s": round(med["raytp_reshard_4to2"], 4),
        "reshard_4to2_ratio_to_torch_load": round(med["raytp_reshard_4to2"] / med["torch_load"], 3),
        "median_s": {k: round(v, 4) for k, v in med.items()},
    }
    return fig
