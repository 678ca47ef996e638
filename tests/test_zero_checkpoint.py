"""Checkpoints under the distributed optimizer: saved at TP=2 x DP=2 and at TP=1 x DP=4, zero 1, every rank
writes the AdamW rows it keeps into a file of its own (DP rank 0's beside the weights), and the checkpoint
reads back at any layout exactly as the same run at zero 0 wrote it: every tensor at TP=1 and at TP=4, one
device's state, and TP=1 x DP=2 and x DP=4 at zero 1 (each rank its own rows); the vocabulary padded (37 at
TP=2), small buckets. Workers
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
from raytp.data.corpus import batch
from raytp.train.optimizer import make_optimizer
from raytp.train.shard_state import shard_state, unshard_state
from raytp.train.step import train_step

STEPS, BUCKET = 3, 3000
LAYOUTS = [(2, 2), (1, 4)]  # (tp, dp) saved, each at zero 0 and zero 1
pytestmark = pytest.mark.slow  # four trainings on 4 processes; tests/test_zero.py[2] is the quick tier's
CFG = gpt_config(vocab=37)


def train_and_write(rank, world, init, roots):
    """For each layout and zero 0, 1: train STEPS, write this rank's file of the checkpoint under
    roots[(tp, dp, zero)]."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    return {key: train_and_write_one(rank, root, *key) for key, root in roots.items()}


def train_and_write_one(rank, root, tp, dp, zero):
    """(file, table, shard state of DP rank 0)."""
    groups = build_groups(Layout(tp, dp=dp, zero=zero), rank)
    model = build_shard(CFG, SEED, groups.tp, False)
    opt = make_optimizer(model, HYPER, dp, groups.dp_rank, zero, bucket_numel=BUCKET)
    data = corpus(CFG.vocab_size)
    for step in range(STEPS):
        x, y = batch(data, "train", SEED, step, groups.dp_rank, dp, 4, CFG.block_size)
        train_step(model, opt, [(x, y)], groups, step, HYPER)
    lead = groups.dp_rank == 0
    if not (lead or zero):
        return None, None, None
    tensors = checkpoint.named_tensors(model, opt, weights=lead)
    written = checkpoint.write_shard(Storage(root), "step-00000003", tensors, groups.tp_rank, tp=tp,
                                     dp_rank=groups.dp_rank)
    table = None
    if lead and groups.tp_rank == 0:
        table = checkpoint.tensor_table({k: v for k, v in tensors.items() if k.startswith("model/") or not zero},
                                        tp, CFG.vocab_size)
        if zero:
            params = {n: p.detach() for n, p in model.named_parameters()}
            table.update(checkpoint.zero_table(params, CFG, tp, dp, bucket_numel=BUCKET))
    return written, table, shard_state(model, opt) if lead else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{(tp, dp): (zero-1 checkpoint, zero-0 checkpoint, one-device state of zero 0's)}, one spawn for all."""
    root = tmp_path_factory.mktemp("zero-ckpt")
    roots = {(tp, dp, zero): str(root / f"tp{tp}-dp{dp}-z{zero}") for tp, dp in LAYOUTS for zero in (0, 1)}
    per_rank = run_ranks(4, train_and_write, roots)
    out = {}
    for tp, dp in LAYOUTS:
        found = []
        for zero in (0, 1):
            key = (tp, dp, zero)
            files = {w["file"]: w["bytes"] for r in per_rank if (w := r[key][0])}
            table = {k: v for r in per_rank if (t := r[key][1]) for k, v in t.items()}
            m = checkpoint.manifest(STEPS, CFG, tp, dp, files, table, zero=zero)
            (root / f"tp{tp}-dp{dp}-z{zero}" / "step-00000003" / "manifest.json").write_text(json.dumps(m))
            found.append(checkpoint.find(roots[key] + "/step-00000003"))
        full = unshard_state([s for r in per_rank if (s := r[(tp, dp, 0)][2])], CFG)
        out[(tp, dp)] = (found[1], found[0], full)
    return out


@pytest.mark.parametrize("tp, dp", LAYOUTS)
def test_zero1_files_read_at_any_layout_as_zero0_wrote_them(saved, tp, dp):
    ckpt, ckpt0, full0 = saved[(tp, dp)]
    assert sorted(ckpt.manifest["files"]) == sorted(f"tp{t:03d}" + (f"-dp{d:03d}" if d else "") + ".safetensors"
                                                    for t in range(tp) for d in range(dp))
    assert ckpt.manifest["layout"]["zero"] == 1 and "zero" not in ckpt0.manifest["layout"]
    spec = ckpt.manifest["tensors"]["optim/h.0.attn.c_proj.weight/exp_avg"]  # row-parallel: blocks transposed
    assert spec["transposed"] and {d for d, _, _ in spec["blocks"]} <= set(range(dp)) and spec["blocks"][0][1] == 0
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
    # TP=1 x DP=2 and x DP=4 (the same layout, for the one saved so), zero 1: each rank keeps its rows of the
    # whole state, and together they hold it all
    for new_dp in (2, 4):
        assert_rows_at(ckpt, full0, new_dp)


def assert_rows_at(ckpt, full0, new_dp):
    rows_seen = {n: 0 for n in full0["model"]}
    for d in range(new_dp):
        model = build_model(CFG)
        opt = make_optimizer(model, HYPER, new_dp, d, 1, bucket_numel=BUCKET)
        checkpoint.load_into(ckpt, model, opt, 0, 1)
        for n, st in opt.named_state().items():
            a, b = opt.rows(n)
            rows_seen[n] += b - a
            assert torch.equal(st["exp_avg_sq"], full0["optim"][n]["exp_avg_sq"][a:b]), (new_dp, d, n)
            assert torch.equal(st["exp_avg"], full0["optim"][n]["exp_avg"][a:b]), (new_dp, d, n)
    assert all(rows_seen[n] == t.shape[0] for n, t in full0["model"].items())
