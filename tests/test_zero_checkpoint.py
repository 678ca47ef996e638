"""Checkpoints under the distributed optimizer: at TP=2 x DP=2, zero 1, every rank writes the AdamW rows it
keeps into a file of its own (DP rank 0's beside the weights), and the checkpoint reads back at any layout
exactly as the same run at zero 0 wrote it: every tensor at TP=1 and at TP=4, one device's state, and
TP=1 x DP=2 zero 1 (each rank its own rows); the vocabulary padded (37 at TP=2), small buckets. Workers
write their files as the runtime does (raytp.files.checkpoint); no Ray: one process per rank (spawn)."""
import json

import pytest
import torch
import torch.distributed as dist
from tp_training import HYPER, SEED, corpus, gpt_config

from raytp.files import checkpoint
from raytp.files.storage import Storage
from raytp.models.registry import build_model
from raytp.models.shard import build_shard
from raytp.parallel.groups import build_groups
from raytp.parallel.layout import Layout
from raytp.parallel.spawn import run_ranks
from raytp.train.data import batch
from raytp.train.optimizer import make_optimizer
from raytp.train.shard_state import shard_state, unshard_state
from raytp.train.step import train_step

TP, DP, STEPS, BUCKET = 2, 2, 3, 3000
pytestmark = pytest.mark.slow  # two trainings on 4 processes; tests/test_zero.py[2] is the quick tier's
CFG = gpt_config(vocab=37)


def train_and_write(rank, world, init, roots):
    """For zero 0 and 1: train STEPS at TP x DP, write this rank's file of the checkpoint under roots[zero]."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    return [train_and_write_one(rank, root, zero) for zero, root in enumerate(roots)]


def train_and_write_one(rank, root, zero):
    """(file, table, shard state of DP rank 0)."""
    groups = build_groups(Layout(TP, dp=DP, zero=zero), rank)
    model = build_shard(CFG, SEED, groups.tp, False)
    opt = make_optimizer(model, HYPER, DP, groups.dp_rank, zero, bucket_numel=BUCKET)
    data = corpus(CFG.vocab_size)
    for step in range(STEPS):
        x, y = batch(data, "train", SEED, step, groups.dp_rank, DP, 4, CFG.block_size)
        train_step(model, opt, [(x, y)], groups, step, HYPER)
    lead = groups.dp_rank == 0
    if not (lead or zero):
        return None, None, None
    tensors = checkpoint.named_tensors(model, opt, weights=lead)
    written = checkpoint.write_shard(Storage(root), "step-00000003", tensors, groups.tp_rank, tp=TP,
                                     dp_rank=groups.dp_rank)
    table = None
    if lead and groups.tp_rank == 0:
        table = checkpoint.tensor_table({k: v for k, v in tensors.items() if k.startswith("model/") or not zero},
                                        TP, CFG.vocab_size)
        if zero:
            params = {n: p.detach() for n, p in model.named_parameters()}
            table.update(checkpoint.zero_table(params, CFG, TP, DP, bucket_numel=BUCKET))
    return written, table, shard_state(model, opt) if lead else None


def write_checkpoints(tmp_path):
    """The checkpoints of the run at zero 0 and at zero 1, and the one-device state of zero 0's."""
    roots = [tmp_path / "z0", tmp_path / "z1"]
    per_rank = run_ranks(TP * DP, train_and_write, [str(r) for r in roots])
    out = []
    for zero, root in enumerate(roots):
        files = {w["file"]: w["bytes"] for r in per_rank if (w := r[zero][0])}
        table = {k: v for r in per_rank if (t := r[zero][1]) for k, v in t.items()}
        m = checkpoint.manifest(STEPS, CFG, TP, DP, files, table, zero=zero)
        (root / "step-00000003" / "manifest.json").write_text(json.dumps(m))
        out.append(checkpoint.find(str(root / "step-00000003")))
    return out[1], out[0], unshard_state([s for r in per_rank if (s := r[0][2])], CFG)


def test_zero1_files_read_at_any_layout_as_zero0_wrote_them(tmp_path):
    ckpt, ckpt0, full0 = write_checkpoints(tmp_path)
    assert sorted(ckpt.manifest["files"]) == ["tp000-dp001.safetensors", "tp000.safetensors",
                                              "tp001-dp001.safetensors", "tp001.safetensors"]
    assert ckpt.manifest["layout"]["zero"] == 1 and "zero" not in ckpt0.manifest["layout"]
    spec = ckpt.manifest["tensors"]["optim/h.0.attn.c_proj.weight/exp_avg"]  # row-parallel: blocks transposed
    assert spec["transposed"] and {d for d, _, _ in spec["blocks"]} <= {0, 1} and spec["blocks"][0][1] == 0
    # zero 0 and zero 1 trained the same bits (tests/test_zero.py); their checkpoints read back the same
    for key in ckpt0.keys():
        assert torch.equal(ckpt.read(key, 0, 1), ckpt0.read(key, 0, 1)), key
        for r in range(4):
            assert torch.equal(ckpt.read(key, r, 4), ckpt0.read(key, r, 4)), (key, r)
    # one device, zero 0: the whole state
    one = build_model(CFG)
    opt = make_optimizer(one, HYPER)
    checkpoint.load_into(ckpt, one, opt, 0, 1)
    for n, p in one.named_parameters():
        assert torch.equal(p.detach(), full0["model"][n]), n
        for k, v in opt.named_state()[n].items():
            assert torch.equal(v, full0["optim"][n][k]), (n, k)
    # TP=1 x DP=2, zero 1: each rank keeps its rows of the whole state, and the two together hold it all
    rows_seen = {n: 0 for n, _ in one.named_parameters()}
    for d in range(2):
        model = build_model(CFG)
        opt = make_optimizer(model, HYPER, 2, d, 1, bucket_numel=BUCKET)
        checkpoint.load_into(ckpt, model, opt, 0, 1)
        for n, st in opt.named_state().items():
            a, b = opt.rows(n)
            rows_seen[n] += b - a
            assert torch.equal(st["exp_avg_sq"], full0["optim"][n]["exp_avg_sq"][a:b]), (d, n)
            assert torch.equal(st["exp_avg"], full0["optim"][n]["exp_avg"][a:b]), (d, n)
    assert all(rows_seen[n] == p.shape[0] for n, p in one.named_parameters())
