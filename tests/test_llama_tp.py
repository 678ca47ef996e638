"""The Llama (grouped-query attention: 8 query heads, 2 KV heads) at TP=1, 2, 4, with and without
sequence parallelism, and at TP=2 x DP=2 trains like the same model on one device: 20 AdamW steps,
per-step loss within 1e-5 relative, final gathered weights within 1e-5. TP=4 exceeds the KV heads:
each rank holds a copy of its KV head and the copies' gradients are summed over the ranks sharing it.
Training and counting collectives are the GPT's (tp_training), given this model's config."""
import numpy as np
import pytest
import torch.distributed as dist
from tp_training import PER_LAYER, PER_LAYER_SP, count_collectives, llama_config, per_layer, train

from raytp.models.args import ModelArgs
from raytp.parallel.groups import ProcessGroups, build_groups
from raytp.parallel.layout import Layout
from raytp.models.registry import check_tp, valid_tp_degrees
from raytp.models.registry import split_of
from raytp.parallel.spawn import run_ranks


def train_runs(rank, world, init, runs):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out = []
    for tp, dp, sp, tied in runs:
        losses, state = train(llama_config(tied), build_groups(Layout(tp, dp=dp), rank), sp)
        out.append((losses, state if rank == 0 else None))
    return out


def one_device_runs(rank, world, init, keys):
    return {tied: train(llama_config(tied), ProcessGroups(Layout(1, dp=1), 0, None, None), False, plain=True)
            for tied in keys}


RUNS = {  # (tp, dp, sequence_parallel, tied) per world size: one spawn each
    1: [(1, 1, False, False)],
    2: [(2, 1, False, False), (2, 1, True, False), (2, 1, False, True)],
    4: [(4, 1, False, False), (4, 1, True, False), (2, 2, False, False), (2, 2, True, True)],
}


@pytest.fixture(scope="module")
def references():
    return run_ranks(1, one_device_runs, [False, True])[0]


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2,  # TP=2: the quick tier's
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_llama_trains_like_one_device(world, references):
    results = run_ranks(world, train_runs, RUNS[world])[0]
    for (tp, dp, sp, tied), (losses, state) in zip(RUNS[world], results):
        name = f"TP={tp} x DP={dp} sp={sp} tied={tied}"
        ref_losses, ref_state = references[tied]
        assert np.mean(ref_losses[-5:]) < ref_losses[0] - 0.5, "the reference itself did not learn"
        rel = np.abs(np.array(losses) - ref_losses) / np.abs(ref_losses)
        assert rel.max() < 1e-5, f"{name}: loss differs from one device by {rel.max():.2e} relative"
        assert state.keys() == ref_state.keys()
        for k in ref_state:
            assert state[k].shape == ref_state[k].shape, f"{name}: {k}"
            diff = float((state[k] - ref_state[k]).abs().max())
            assert diff < 1e-5, f"{name}: final {k} differs by {diff:.2e}"


@pytest.mark.slow  # a TP=4 spawn
def test_collectives_per_layer_with_shared_kv_heads():
    """TP=4 > 2 KV heads: still 2 all-reduces forward and 2 backward per layer (SP: their halves)."""
    counts = run_ranks(4, count_collectives, llama_config)[0]
    assert per_layer(counts[False]) == PER_LAYER
    assert per_layer(counts[True]) == PER_LAYER_SP


def test_kv_heads_split_then_shared():
    cfg = llama_config()
    kv = split_of("layers.0.self_attn.k_proj.weight", cfg)
    from raytp.parallel.sharding import local_shape, shard_ranges
    assert local_shape(kv, (8, 32), 2) == (4, 32)  # 2 ranks, one KV head (4 rows) each
    assert local_shape(kv, (8, 32), 4) == (4, 32)  # 4 ranks: ranks 0, 1 share head 0; 2, 3 head 1
    assert [shard_ranges(kv, 8, r, 4) for r in range(4)] == [[range(0, 4)]] * 2 + [[range(4, 8)]] * 2
    assert [kv.owns(r, 4) for r in range(4)] == [True, False, True, False]
    with pytest.raises(ValueError, match="needs|pass the model config"):
        split_of("layers.0.self_attn.v_proj.weight")


def test_invalid_tp_names_the_kv_heads_and_the_valid_degrees():
    cfg = ModelArgs(arch="llama", n_head=12, n_kv_head=4, n_embd=48, intermediate_size=96)
    with pytest.raises(ValueError, match=r"tp=6 neither divides nor is a multiple of n_kv_head=4; "
                                         r"valid tp degrees: 1, 2, 4, 12"):
        check_tp(cfg, 6)
    assert valid_tp_degrees(cfg) == [1, 2, 4, 12]
