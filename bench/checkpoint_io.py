"""checkpoint_io: raytp's worker-written checkpoints vs PyTorch Distributed Checkpoint (DCP), same state.

A GPT (8 layers x 512 wide, ~25M parameters) at TP=4, four gloo ranks (spawned
processes, one thread each, no Ray: this measures the checkpoint path alone),
trained with AdamW so its optimizer state exists. Measured in one run:

- training pause per save. raytp: every rank begins writing its own file
  (raytp.runtime.worker.background_save) at a step boundary and trains on. With
  snapshots on (here every step, the most costly setting) the file is written from the snapshot's in-memory
  copy and nothing waits; with them off it is written from the live tensors and
  the next optimizer update waits until the bytes are handed to the file. The
  pause is the time of the steps the save spans minus as many plain steps. DCP: ``dcp.save`` of the same sharded
  state (``get_state_dict`` of the DTensor-parallel model and its AdamW), a
  synchronous save: the pause is its time.
- load with resharding TP=4 -> TP=2: two new ranks each build their shard and
  read their slices. raytp: ``checkpoint.load_into`` (byte ranges of the TP=4
  files); DCP: ``dcp.load`` into the TP=2 DTensor model's state dict and
  ``set_state_dict``. Each side loads what it saved; raytp's load is checked
  against a one-device reference.

Files go to a temporary directory on the system disk; saves are written and
read back soon after, so reads are usually served by the page cache for both
alike. Medians over ``reps`` saves and loads; the order of the two sides
alternates. Quick mode (a smoke test of this code, no figure to quote) runs each side once, the
sides' saves in one spawn of four ranks and their loads in one spawn of two.
"""
from __future__ import annotations

import importlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import SEED, build_dtensor_gpt, dtensor_step, spawn
from raytp.models.args import ModelArgs
from raytp.parallel.groups import build_groups
from raytp.parallel.layout import Layout
from raytp.train.hyper import Hyper
from raytp.train.step import make_optimizer, train_step

PEER = ("PyTorch Distributed Checkpoint: dcp.save (synchronous) / dcp.load of the same sharded model + AdamW "
        "state (DTensor TP), resharding TP=4 -> TP=2 on load")
FULL = {"cfg": ModelArgs(n_layer=8, n_head=8, n_embd=512, block_size=64, vocab_size=256, dropout=0.0),
        "batch": 4, "reps": 3, "steps_between": 2}
QUICK = {"cfg": ModelArgs(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256, dropout=0.0),
         "batch": 2, "reps": 1, "steps_between": 1}
TP_SAVED, TP_LOADED = 4, 2
HYPER = Hyper(lr=1e-3, lr_schedule="constant", warmup_steps=0, weight_decay=0.1, grad_clip=1.0, seed=SEED)
GB = 1e9


def _batch(p: dict, step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, p["cfg"].vocab_size, (p["batch"], p["cfg"].block_size), generator=g)
    return x, torch.roll(x, -1, 1)


def _join(rank: int, world: int, init: str) -> None:
    """Joins the ranks' gloo group, unless an earlier side in the same spawn did (quick mode: `_in_turn`)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)


def _in_turn(rank: int, world: int, init: str, calls: list) -> list:
    """Each (fn, *args) of `calls` on these ranks, one after another: quick mode runs every side's save in one
    spawn and every side's load in another, not a spawn each (the process starts would be most of its time)."""
    return [fn(rank, world, init, *args) for fn, *args in calls]


def _commit(root: str, step: int, cfg: ModelArgs, table: dict, files: dict) -> str:
    """Rank 0 does what the driver does: the manifest last (no Ray here)."""
    import json
    from raytp.files import checkpoint
    from raytp.files.storage import Storage
    m = checkpoint.manifest(step, cfg, TP_SAVED, 1, files, table)
    Storage(root).write_bytes(f"{checkpoint.step_dir(step)}/{checkpoint.MANIFEST}", json.dumps(m).encode())
    return f"{root}/{checkpoint.step_dir(step)}"


def raytp_save(rank: int, world: int, init: str, p: dict, root: str, staged: bool) -> dict:
    """Saves between plain steps. `staged`: as a worker does when it snapshots every step
    (recovery.snapshot_every: 1; the default budget snapshots every few steps):
    the file is written from that in-memory copy and training does not wait; else from the live tensors,
    the next update waiting until every byte is handed to the file. Per save: the time from its start
    to the end of the step during which it finished, and how many steps that was."""
    from raytp.models.shard import build_shard
    from raytp.runtime.worker.background_save import BackgroundSave
    from raytp.files import checkpoint
    from raytp.train.shard_state import live_state, pack_state, state_bytes, unpack_state
    from raytp.files.storage import Storage
    torch.set_num_threads(1)
    _join(rank, world, init)
    groups = build_groups(Layout(world, dp=1), rank)
    model = build_shard(p["cfg"], SEED, groups.tp)
    opt = make_optimizer(model, HYPER)
    plain, saving, step, bufs, packed, holder = [], [], 0, [], None, {}

    def one_step(before_update=None):
        """A training step; staged: and the snapshot after it, packed into one of two reused buffers (what a
        worker does with recovery.snapshot_every: 1), so that plain steps carry the snapshot's cost too. A buffer a
        file is written from is packed again only once that file is written (SnapshotBuffers.hold)."""
        nonlocal step, packed
        train_step(model, opt, [_batch(p, step)], groups, step, HYPER, before_update=before_update)
        step += 1
        if staged:
            state = live_state(model, opt)
            while len(bufs) < 2:
                bufs.append(torch.empty(state_bytes(state), dtype=torch.uint8))
            if holder.get(step % 2) is not None:
                holder.pop(step % 2).done.wait()
            packed = pack_state(state, out=bufs[step % 2])

    one_step()
    for rep in range(p["reps"]):
        for _ in range(p["steps_between"]):  # steps without a save
            t0 = time.perf_counter()
            one_step()
            plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if staged:  # from the newest snapshot; its buffer is not packed again until the file is written
            tensors = checkpoint.state_tensors(unpack_state(packed, views=True))
        else:
            tensors = checkpoint.named_tensors(model, opt)
        save = BackgroundSave(Storage(root), checkpoint.step_dir(step), tensors, rank, torch.device("cpu"),
                              staged=staged)
        if staged:
            holder[step % 2] = save
        saved_at, n = step, 0
        while True:  # the steps during which the file is written (each rank decides together: all_reduce)
            one_step(before_update=save.copied.wait)
            n += 1
            pending = torch.tensor([0.0 if save.done.is_set() else 1.0])
            dist.all_reduce(pending)
            if pending.item() == 0:
                break
        saving.append((time.perf_counter() - t0, n))
        written = save.wait()
        everyone = [None] * world
        dist.all_gather_object(everyone, written)
        table = checkpoint.tensor_table(tensors, world, p["cfg"].vocab_size)
        if rank == 0:
            _commit(root, saved_at, p["cfg"], table, {w["file"]: w["bytes"] for w in everyone})
        dist.barrier()
    return {"plain": plain, "saving": saving, "last_step": saved_at}


def raytp_load(rank: int, world: int, init: str, p: dict, directory: str) -> dict:
    from raytp.models.shard import build_empty_shard
    from raytp.files import checkpoint
    from raytp.files.storage import Storage
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # what the first optimizer imports, paid by a worker at its start
    _join(rank, world, init)
    groups = build_groups(Layout(world, dp=1), rank)
    dist.barrier()
    t0 = time.perf_counter()
    model = build_empty_shard(p["cfg"], groups.tp)
    opt = make_optimizer(model, HYPER)
    head, _, name = directory.rpartition("/")
    checkpoint.load_into(checkpoint.open_checkpoint(Storage(head), name), model, opt, rank, world)
    seconds = time.perf_counter() - t0
    sample = {n: t.detach().clone() for n, t in model.named_parameters() if n in ("wte.weight", "h.0.mlp.c_proj.weight")}
    return {"seconds": seconds, "sample": sample}


def dcp_save(rank: int, world: int, init: str, p: dict, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.set_num_threads(1)
    _join(rank, world, init)
    model = build_dtensor_gpt(p["cfg"], world)
    opt = torch.optim.AdamW(model.parameters(), lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2),
                            weight_decay=HYPER.weight_decay, foreach=False)
    plain, saving, step = [], [], 0
    for rep in range(p["reps"]):
        for _ in range(p["steps_between"]):
            t0 = time.perf_counter()
            dtensor_step(model, opt, *_batch(p, step), step, HYPER)
            plain.append(time.perf_counter() - t0)
            step += 1
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp-{step}")
        saving.append(time.perf_counter() - t0)
        dtensor_step(model, opt, *_batch(p, step), step, HYPER)
        step += 1
    return {"plain": plain, "saving": saving, "last_step": step - 1}


def dcp_load(rank: int, world: int, init: str, p: dict, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import _init_optim_state, get_state_dict, set_state_dict
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # as on the raytp side
    _join(rank, world, init)
    dist.barrier()
    t0 = time.perf_counter()
    model = build_dtensor_gpt(p["cfg"], world)
    opt = torch.optim.AdamW(model.parameters(), lr=HYPER.lr, foreach=False)
    _init_optim_state(opt)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"seconds": time.perf_counter() - t0}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def run(quick: bool = False) -> dict:
    p = QUICK if quick else FULL
    tmp = Path(tempfile.mkdtemp(prefix="raytp-bench-ckpt-"))
    try:
        out = {}
        sides = {"raytp": (raytp_save, raytp_load, (True,)), "raytp_live": (raytp_save, None, (False,)),
                 "dcp": (dcp_save, dcp_load, ())}
        order = ["raytp", "raytp_live", "dcp", "dcp", "raytp_live", "raytp"] if not quick else ["raytp", "dcp"]
        saves: dict = {k: [] for k in sides}
        loads: dict = {k: [] for k in sides}
        sizes: dict = {}
        spawns = [list(enumerate(order))] if quick else [[(i, side)] for i, side in enumerate(order)]
        for batch in spawns:
            roots = {i: str(tmp / f"{side}-{i}") for i, side in batch}
            for root in roots.values():
                os.makedirs(root)
            saved = spawn(TP_SAVED, _in_turn, [(sides[side][0], p, roots[i], *sides[side][2]) for i, side in batch])
            directories = {}
            for j, (i, side) in enumerate(batch):
                res = [r[j] for r in saved]
                plain = statistics.median(t for r in res for t in r["plain"])
                if side == "dcp":  # synchronous: the save is the pause (the slowest rank's)
                    saves[side] += [max(r["saving"][k] for r in res) for k in range(p["reps"])]
                else:  # the steps it spanned against as many plain steps
                    saves[side] += [max(r["saving"][k][0] for r in res) - res[0]["saving"][k][1] * plain
                                    for k in range(p["reps"])]
                last = res[0]["last_step"]
                directories[i] = f"{roots[i]}/step-{last:08d}" if side != "dcp" else f"{roots[i]}/dcp-{last}"
                sizes[side] = _dir_bytes(directories[i])
            loading = [(i, side) for i, side in batch if sides[side][1] is not None]
            if loading:
                loaded = spawn(TP_LOADED, _in_turn, [(sides[side][1], p, directories[i]) for i, side in loading])
                for j, (i, side) in enumerate(loading):
                    res = [r[j] for r in loaded]
                    loads[side].append(max(r["seconds"] for r in res))
                    if side == "raytp":
                        out["raytp_load_checked"] = _check(p, res)
            for root in roots.values():
                shutil.rmtree(root)
        med = {f"{k}_{what}": statistics.median(v) for what, d in (("pause_s", saves), ("load_s", loads))
               for k, v in d.items() if v}
        with torch.device("meta"):
            from raytp.models.gpt2.model import GPT
            n_params = GPT(p["cfg"]).num_params()
        return {
            "peer": PEER,
            "model": f"GPT {p['cfg'].n_layer}L x {p['cfg'].n_embd} wide, {n_params / 1e6:.1f}M params, AdamW, "
                     f"float32, TP={TP_SAVED} saved, TP={TP_LOADED} loaded",
            "raytp_files_gb": round(sizes["raytp"] / GB, 3), "dcp_files_gb": round(sizes["dcp"] / GB, 3),
            "saves_each": p["reps"] * order.count("raytp"),
            "raytp_pause_per_save_s": round(med["raytp_pause_s"], 4),
            "raytp_pause_note": "written from the snapshot's in-memory copy (recovery.snapshot_every: 1, "
                                "the most costly setting); the pause is the slowdown of the steps the write overlaps (every step packs a snapshot)",
            "raytp_live_pause_per_save_s": round(med["raytp_live_pause_s"], 4) if saves["raytp_live"] else None,
            "raytp_live_note": "snapshots off: written from the live tensors, the next update waits for the bytes",
            "dcp_save_s": round(med["dcp_pause_s"], 4),
            "ratio_pause_to_dcp_save": round(max(med["raytp_pause_s"], 0.0) / med["dcp_pause_s"], 3),
            "ratio_live_pause_to_dcp_save": (round(max(med["raytp_live_pause_s"], 0.0) / med["dcp_pause_s"], 3)
                                             if saves["raytp_live"] else None),
            "goal_pause": "<= 0.3",
            "raytp_load_reshard_s": round(med["raytp_load_s"], 4),
            "dcp_load_reshard_s": round(med["dcp_load_s"], 4),
            "ratio_load_to_dcp": round(med["raytp_load_s"] / med["dcp_load_s"], 3),
            "goal_load": "<= 1.0",
            **out,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check(p: dict, loaded: list[dict]) -> bool:
    """The TP=2 shards loaded from the TP=4 files fit together: rank 0 and 1 hold disjoint vocabulary rows
    of the right shape (the exact slices are tested in tests/test_checkpoint.py)."""
    a, b = loaded[0]["sample"]["wte.weight"], loaded[1]["sample"]["wte.weight"]
    return a.shape == b.shape == (p["cfg"].vocab_size // TP_LOADED, p["cfg"].n_embd) and not torch.equal(a, b)
