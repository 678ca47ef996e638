"""The whole GPT at TP=1, 2, 4 (with and without sequence parallelism) and at
TP=2 x DP=2 trains like the same model on one device: 20 AdamW steps, per-step
loss within 1e-5 relative, final gathered weights within 1e-5."""
import numpy as np
import pytest
import torch
import torch.distributed as dist
from tp_training import (HYPER, PER_LAYER, PER_LAYER_SP, SEED, count_collectives, gpt_config, per_layer, train,
                         without_key_bias)

from raytp.models.args import ModelArgs
from raytp.models.gpt2.model import GPT
from raytp.parallel.groups import ProcessGroups, build_groups
from raytp.parallel.layout import Layout
from raytp.models.registry import check_tp, valid_tp_degrees
from raytp.models.shard import build_shard
from raytp.parallel.sharding import padded_vocab
from raytp.parallel.spawn import run_ranks


def train_runs(rank, world, init, runs):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out = []
    for tp, dp, sp, dropout, vocab in runs:
        groups = build_groups(Layout(tp, dp=dp), rank)
        losses, state = train(gpt_config(vocab, dropout), groups, sp)
        out.append((losses, state if rank == 0 else None))
    return out


def one_device(dropout=0.0, vocab=256):
    return train(gpt_config(vocab, dropout), ProcessGroups(Layout(1, dp=1), 0, None, None), sp=False)


# (tp, dp, sequence_parallel, dropout, vocab) per world size: one spawn each.
RUNS = {
    1: [(1, 1, False, 0.0, 256), (1, 1, False, 0.1, 256)],
    2: [(2, 1, False, 0.0, 256), (2, 1, True, 0.0, 256), (2, 1, False, 0.1, 256), (2, 1, True, 0.1, 256)],
    4: [(4, 1, False, 0.0, 256), (4, 1, True, 0.0, 256), (2, 2, False, 0.0, 256), (2, 2, True, 0.0, 256),
        (4, 1, False, 0.1, 257), (4, 1, True, 0.1, 257)],  # dropout and a padded vocab (257 -> 260) at once
}


def one_device_runs(rank, world, init, keys):
    return {(d, v): one_device(d, v) for d, v in keys}


@pytest.fixture(scope="module")
def references():
    """references(world): the one-device runs RUNS[world] needs (those run before are kept), in a process of
    their own with one thread, like each rank."""
    done = {}

    def of(world):
        keys = sorted({(r[3], r[4]) for r in RUNS[world]} - set(done))
        if keys:
            done.update(run_ranks(1, one_device_runs, keys)[0])
        return done
    return of


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2,  # TP=2: the quick tier's
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_gpt_trains_like_one_device(world, references):
    results = run_ranks(world, train_runs, RUNS[world])[0]
    for (tp, dp, sp, dropout, vocab), (losses, state) in zip(RUNS[world], results):
        name = f"TP={tp} x DP={dp} sp={sp} dropout={dropout} vocab={vocab}"
        ref_losses, ref_state = references(world)[(dropout, vocab)]
        assert np.mean(ref_losses[-5:]) < ref_losses[0] - 0.5, "the reference itself did not learn"
        rel = np.abs(np.array(losses) - ref_losses) / np.abs(ref_losses)
        assert rel.max() < 1e-5, f"{name}: loss differs from one device by {rel.max():.2e} relative"
        assert state.keys() == ref_state.keys()
        state, ref_state = without_key_bias(state), without_key_bias(ref_state)
        for k in ref_state:
            assert state[k].shape == ref_state[k].shape, f"{name}: {k}"
            diff = float((state[k] - ref_state[k]).abs().max())
            assert diff < 1e-5, f"{name}: final {k} differs by {diff:.2e}"


def test_dropout_changes_training(references):
    """Guards the test above: keyed dropout is really applied (losses differ from dropout 0); read off the
    one-device references that test compares with."""
    refs = references(2)
    assert refs[(0.1, 256)][0][1:] != refs[(0.0, 256)][0][1:]


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_per_layer(tp):
    counts = run_ranks(tp, count_collectives)[0]
    assert per_layer(counts[False]) == PER_LAYER
    assert per_layer(counts[True]) == PER_LAYER_SP


def test_indivisible_sizes_are_rejected_with_valid_degrees():
    cfg = ModelArgs(n_head=6, n_embd=48)
    with pytest.raises(ValueError, match=r"tp=4 does not divide n_head=6; valid tp degrees: 1, 2, 3, 6"):
        check_tp(cfg, 4)
    assert valid_tp_degrees(ModelArgs(n_head=4, n_embd=128)) == [1, 2, 4]
    assert padded_vocab(257, 4) == 260 and padded_vocab(256, 4) == 256


def test_one_device_model_is_gpt2_shaped():
    m = GPT(gpt_config())
    assert m.lm_head.weight is m.wte.weight
    assert all(mod.bias is not None for mod in m.modules() if isinstance(mod, torch.nn.Linear) and mod is not m.lm_head)
    assert {n for n, _ in m.named_parameters()} >= {"wte.weight", "wpe.weight", "h.0.attn.c_attn.weight",
                                                    "h.0.mlp.c_fc.bias", "ln_f.weight"}


def empty_shard_matches(rank, world, init):
    """build_empty_shard + this rank's slices of the full state == build_shard, with and without SP."""
    from raytp.models.shard import build_empty_shard
    from raytp.train.shard_state import load_shard_state, slice_state
    from raytp.train.step import make_optimizer
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = build_groups(Layout(world, dp=1), rank)
    cfg = gpt_config(vocab=257)
    full = {"model": {n: p.detach() for n, p in GPT(cfg, seed=SEED).named_parameters()}, "optim": {}}
    out = []
    for sp in (False, True):
        seeded = build_shard(cfg, SEED, groups.tp, sp)
        empty = build_empty_shard(cfg, groups.tp, sp)
        load_shard_state(empty, make_optimizer(empty, HYPER), slice_state(full, rank, world))
        a, b = dict(seeded.named_parameters()), dict(empty.named_parameters())
        out.append((list(a) == list(b), all(torch.equal(a[n], b[n]) for n in a),
                    {n for n, p in a.items() if getattr(p, "sequence_parallel", False)}
                    == {n for n, p in b.items() if getattr(p, "sequence_parallel", False)},
                    empty.lm_head.weight is empty.wte.weight, all(p.device.type == "cpu" for p in b.values())))
    return out


@pytest.mark.slow
def test_empty_shard_takes_its_slices_like_a_seeded_one():
    for per_rank in run_ranks(2, empty_shard_matches):
        assert per_rank == [(True, True, True, True, True)] * 2


INIT_CFG = ModelArgs(n_layer=2, n_head=12, n_embd=48, block_size=16, vocab_size=257)  # tp 1..4 all valid


def shards_at_tp_1_to_4(rank, world, init):
    """In one world of 4: the seeded shards of this rank at TP=1 (alone), 2, 3 and 4 (subgroups)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = {tp: dist.new_group(list(range(tp))) for tp in (2, 3)}  # collective: every rank makes every group
    out = {}
    for tp in (1, 2, 3, 4):
        if rank < tp:
            group = None if tp == 1 else dist.group.WORLD if tp == 4 else groups[tp]
            out[tp] = {n: p.detach() for n, p in build_shard(INIT_CFG, SEED, group).named_parameters()}
    return out


@pytest.mark.slow
def test_each_shard_is_the_matching_slice_of_the_one_device_init():
    from raytp.models.registry import split_of
    from raytp.parallel.sharding import shard_tensor
    full = {n: p.detach() for n, p in GPT(INIT_CFG, seed=SEED).named_parameters()}
    assert full["wte.weight"].std() > 0.01 and float(full["h.0.ln_1.weight"].min()) == 1.0
    for rank, by_tp in enumerate(run_ranks(4, shards_at_tp_1_to_4)):
        for tp, shard in by_tp.items():
            assert list(shard) == list(full)
            for n, t in shard.items():
                expect = shard_tensor(full[n], split_of(n), rank, tp)
                assert torch.equal(t, expect), f"TP={tp} rank {rank}: {n} differs from the one-device init"
    other = {n: p.detach() for n, p in GPT(INIT_CFG, seed=SEED + 1).named_parameters()}
    assert not torch.equal(other["wte.weight"], full["wte.weight"])
