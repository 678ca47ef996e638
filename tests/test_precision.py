"""bf16 mixed precision and activation checkpointing on the Llama (GQA, 8 query / 2 KV heads).

- bf16 at TP=2 tracks bf16 at TP=1 within bf16's rounding, and fp32 within a
  looser, documented bound, over 50 AdamW steps; the weights stay float32.
- bf16 halves the bytes of the TP collectives of every layer.
- Activation checkpointing leaves losses and weights bitwise unchanged (GPT
  with keyed dropout, and Llama under sequence parallelism)."""
import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tp_training import COLLECTIVES, corpus, gpt_config, llama_config

from raytp.parallel.groups import ProcessGroups, build_groups
from raytp.parallel.layout import Layout
from raytp.models.shard import build_shard
from raytp.parallel.spawn import run_ranks
from raytp.data.corpus import batch
from raytp.train.hyper import Hyper
from raytp.train.step import make_optimizer, train_step

SEED = 1
# Measured 2026-12-01 (worst step of 50, relative to the loss, which falls from 5.56 to 2.39): bf16 TP=2 vs
# bf16 TP=1 1.8e-3; bf16 vs fp32 2.3e-3 (TP=1) and 2.2e-3 (TP=2); fp32 TP=2 vs TP=1 1.8e-7. bf16 rounds to
# 2^-9 = 2e-3 relative. The bounds leave about 3x room.
BF16_VS_BF16, BF16_VS_FP32 = 6e-3, 7e-3


def hyper(steps, precision):
    return Hyper(lr=1e-2, min_lr=3e-4, warmup_steps=5, steps=steps, grad_clip=1.0, seed=SEED, precision=precision)


def train(cfg, groups, sp, steps, precision="fp32", checkpointing=False):
    model = build_shard(cfg, SEED, groups.tp, sp)
    model.activation_checkpointing = checkpointing
    h = hyper(steps, precision)
    opt = make_optimizer(model, h)
    data = corpus(cfg.vocab_size)
    losses = []
    for step in range(steps):
        x, y = batch(data, "train", SEED, step, groups.dp_rank, groups.layout.dp, 8, cfg.block_size)
        losses.append(train_step(model, opt, [(x, y)], groups, step, h).loss)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def runs(rank, world, init, specs):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out = []
    for cfg, tp, sp, steps, precision, checkpointing in specs:
        groups = build_groups(Layout(tp, dp=1), rank) if tp > 1 else ProcessGroups(Layout(1, dp=1), 0, None, None)
        out.append(train(cfg, groups, sp, steps, precision, checkpointing))
    return out


def rel(a, b):
    return float(np.max(np.abs(np.array(a) - np.array(b)) / np.abs(np.array(b))))


def test_bf16_tracks_one_device_bf16_and_fp32():
    cfg = llama_config()
    one = run_ranks(1, runs, [(cfg, 1, False, 50, "bf16", False), (cfg, 1, False, 50, "fp32", False)])[0]
    two = run_ranks(2, runs, [(cfg, 2, False, 50, "bf16", False), (cfg, 2, False, 50, "fp32", False)])[0]
    (b1, _), (f1, _) = one
    (b2, _), (f2, _) = two
    assert np.mean(f1[-5:]) < f1[0] - 0.5, "the fp32 reference did not learn"
    assert b1 != f1, "bf16 should not be fp32 bit for bit (is autocast applied?)"
    assert any(float(torch.tensor(v).bfloat16()) != v for v in b2), "the loss itself was rounded to bf16"
    assert rel(b2, b1) < BF16_VS_BF16, f"bf16 TP=2 vs TP=1: {rel(b2, b1):.2e}"
    assert rel(b1, f1) < BF16_VS_FP32 and rel(b2, f2) < BF16_VS_FP32, (rel(b1, f1), rel(b2, f2))
    assert rel(f2, f1) < 1e-5


def collective_bytes(rank, world, init, precision):
    """Bytes the TP collectives of forward + backward move, for 1- and 2-layer models."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = build_groups(Layout(world, dp=1), rank)
    moved = [0]
    originals = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}

    def counting(fn):
        def wrapper(*a, **k):
            moved[0] += sum(t.numel() * t.element_size() for t in a if torch.is_tensor(t))
            return fn(*a, **k)
        return wrapper

    for n, fn in originals.items():
        setattr(dist, n, counting(fn))
    try:
        out = []
        for n_layer in (1, 2):
            model = build_shard(llama_config(n_layer=n_layer), SEED, groups.tp, False)
            x = torch.randint(256, (2, 16))
            moved[0] = 0
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(x, x)
            loss.backward()
            out.append(moved[0])
        return out[1] - out[0]  # one layer's worth
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


@pytest.mark.slow
def test_bf16_halves_the_tp_bytes_per_layer():
    fp32 = run_ranks(2, collective_bytes, "fp32")[0]
    bf16 = run_ranks(2, collective_bytes, "bf16")[0]
    assert fp32 > 0 and bf16 * 2 == fp32, (fp32, bf16)


@pytest.mark.slow
def test_activation_checkpointing_is_bitwise_neutral():
    gpt = gpt_config(dropout=0.1)
    llama = dataclasses.replace(llama_config(), block_size=16)
    specs = [(gpt, 2, False, 6, "fp32", False), (gpt, 2, False, 6, "fp32", True),
             (llama, 2, True, 6, "fp32", False), (llama, 2, True, 6, "fp32", True),
             (llama, 2, False, 6, "bf16", False), (llama, 2, False, 6, "bf16", True)]
    out = run_ranks(2, runs, specs)[0]
    for i in range(0, len(out), 2):
        (la, wa), (lb, wb) = out[i], out[i + 1]
        assert la == lb, specs[i]
        assert all(torch.equal(wa[k], wb[k]) for k in wa), specs[i]


def saved_bytes(model, x):
    """Bytes autograd keeps for backward during one forward."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    return total[0]


def test_activation_checkpointing_keeps_less_for_backward():
    from raytp.models.registry import build_model
    model = build_model(dataclasses.replace(llama_config(), n_layer=4), seed=SEED)
    x = torch.randint(256, (4, 16))
    full = saved_bytes(model, x)
    model.activation_checkpointing = True
    assert saved_bytes(model, x) < full / 2
