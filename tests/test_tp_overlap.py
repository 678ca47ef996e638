"""The TP entries' backward collectives overlapped with the weight-gradient GEMMs (raytp.parallel.overlap,
``parallel.tp_overlap``) take the same steps, bit for bit, as without: GPT-2 (a column-parallel linear with its
own entry, the tied vocabulary-parallel head) and Llama with grouped-query attention and Qwen2's q/k/v biases
(one entry feeding several projections), with and without sequence parallelism, in float32 and under bf16
autocast, at TP=2 (and TP=2 x DP=2, whose gradient buckets launch from the same backward pass). And the
collectives ran while the GEMMs did: each rank counts time its entry collectives spent behind compute, and
collectives that ended before they were waited for. Without Ray: one process per rank, gloo."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from tp_training import HYPER, SEED, corpus, gpt_config, llama_config

from raytp.data.corpus import batch
from raytp.models.shard import build_shard, gather_full_state
from raytp.parallel import comm, overlap
from raytp.parallel.groups import build_groups
from raytp.parallel.layers import set_tp_overlap
from raytp.parallel.layout import Layout
from raytp.parallel.spawn import run_ranks
from raytp.train.step import make_optimizer, train_step

STEPS = 6


def configs():
    qwen = dataclasses.replace(llama_config(), qkv_bias=True)
    return {"gpt2": gpt_config(), "llama": llama_config(), "llama_tied": llama_config(tied=True), "qwen2": qwen}


def run(cfg, groups, sp, on, bf16):
    model = build_shard(cfg, SEED, groups.tp, sp)
    set_tp_overlap(model, on)
    opt = make_optimizer(model, HYPER, groups.layout.dp, groups.dp_rank, overlap=True)
    data = corpus(cfg.vocab_size)
    losses = []
    comm.STATS.take(), comm.STATS.take_hidden()
    for step in range(STEPS):
        x, y = batch(data, "train", SEED, step, groups.dp_rank, groups.layout.dp, 8, cfg.block_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            losses.append(train_step(model, opt, [(x, y)], groups, step, HYPER).loss)
    return losses, gather_full_state(model, groups.tp), comm.STATS.take_hidden()


def pairs(rank, world, init, dp):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = build_groups(Layout(world // dp, dp=dp), rank)
    out = {}
    for name, cfg in configs().items():
        for sp in (False, True):
            for bf16 in ((False, True) if name in ("gpt2", "llama") else (False,)):
                out[(name, sp, bf16)] = [run(cfg, groups, sp, on, bf16) for on in (False, True)]
    return out


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_overlapped_entries_take_the_same_steps_bit_for_bit(dp):
    per_rank = run_ranks(2 * dp, pairs, dp, timeout_s=600)
    for rank, runs in enumerate(per_rank):
        for (name, sp, bf16), ((losses, state, hidden0), (losses_o, state_o, hidden)) in runs.items():
            what = f"{name} sp={sp} bf16={bf16} rank {rank}"
            assert hidden0 == 0.0 and hidden > 0.0, f"{what}: hidden collective time {hidden0}, {hidden}"
            assert losses_o == losses, f"{what}: overlap changed the losses {losses} -> {losses_o}"
            for k, t in state.items():
                assert torch.equal(t, state_o[k]), f"{what}: {k} differs with overlap"


def timing(rank, world, init):
    """A Llama wide enough that a weight-gradient GEMM takes longer than a loopback all-reduce of its input's
    gradient: how many entry collectives ended before they were waited for, of how many."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = build_groups(Layout(world), rank)
    cfg = dataclasses.replace(llama_config(), n_embd=512, intermediate_size=2048, n_head=8, block_size=128)
    model = build_shard(cfg, SEED, groups.tp, False)
    set_tp_overlap(model, True)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    behind = []
    real = overlap.finish_entry_grad

    def finish(p):
        dist_done = p.work.is_completed()  # before the wait: it ran while the GEMMs did
        behind.append(dist_done)
        return real(p)
    overlap.finish_entry_grad = finish
    passes = 0
    try:  # on a loaded machine more passes, until several collectives have ended early on both ranks
        while passes < 3 or (passes < 12 and not _both_saw(sum(behind) >= 3)):
            model(x, x).backward()
            passes += 1
    finally:
        overlap.finish_entry_grad = real
    return sum(behind), len(behind), passes


def _both_saw(mine: bool) -> bool:
    """Whether every rank says yes (the ranks run the same passes, so they decide together)."""
    flag = torch.tensor([0 if mine else 1])
    dist.all_reduce(flag)
    return int(flag) == 0


def test_entry_collectives_end_while_the_weight_gradients_are_computed():
    for done, total, passes in run_ranks(2, timing):
        assert total == passes * (2 * 2 + 1)  # each backward pass: 2 layers of 2 entries, and the head's
        assert done > 0, f"no entry collective ended before its wait ({done} of {total})"
