"""Expert parallelism trains like one device: the Mixtral-style and DeepSeek-style MoE Llamas with their
experts spread over ranks, tokens sent to them by all-to-all, at EP=2 (over DP), EP=4, TP=2 x DP=2 x EP=2
with etp 1 (EP over the TP ranks, each holding whole experts and routing its share of the tokens; with and
without SP) and etp 2 (EP over the replicas, each expert split over TP), and PP=2 x DP=2 x EP=2: 20 AdamW steps,
losses within 1e-5 relative and final weights (every expert gathered from where it lives) within the bound
of test_moe_tp; with a capacity factor, what each expert drops is the same at EP=2. Each rank holds only its
experts; expert gradients are summed over expert-DP, not DP. Under the distributed optimizer (zero 1: EP=2,
with the DeepSeek-style selection bias; TP=2 x DP=2 x EP=2 with etp 1 and DP=4 x EP=2, each an expert-DP group
of 2) each rank keeps the AdamW state of its rows of the dense weights and of its experts (whole at expert-DP 1,
its rows of them cut over expert-DP above), and trains the same.
Without Ray: one process per rank, gloo."""
import numpy as np
import pytest
import torch
import torch.distributed as dist
from tp_training import (BATCH, HYPER, SEED, STEPS, WEIGHTS_TOL, assert_table_holds, corpus, gathered, moe_config,
                         train)

from raytp.data.corpus import batch
from raytp.models.moe.plan import ExpertPlace
from raytp.models.registry import bucketed, is_expert_weight
from raytp.models.shard import build_shard
from raytp.models.stage import stage_of
from raytp.parallel.groups import ProcessGroups, build_groups
from raytp.parallel.layout import Layout
from raytp.parallel.spawn import run_ranks
from raytp.train.optimizer import make_optimizer
from raytp.train.row_cut import experts_cut
from raytp.train.stage_runner import PipelineSchedule
from raytp.train.step import train_step


def train_runs(rank, world, init, runs, overlap=False):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out = []
    for which, tp, pp, dp, ep, etp, sp, zero in runs:
        cfg = moe_config(which)
        lay = Layout(tp, pp=pp, dp=dp, ep=ep, etp=etp)
        groups = build_groups(lay, rank)
        stage = stage_of(cfg, pp, groups.pp_rank) if pp > 1 else None
        model = build_shard(cfg, SEED, groups.tp, sp, stage=stage, experts=ExpertPlace.of(groups))
        held = sorted({n.split(".")[4] for n in dict(model.named_parameters()) if is_expert_weight(n)}, key=int)
        opt = make_optimizer(model, HYPER, dp, groups.dp_rank, zero=zero, overlap=overlap,
                             apart=is_expert_weight if lay.experts_split else None,
                             **experts_cut(Layout(tp, pp=pp, dp=dp, ep=ep, etp=etp, zero=zero), rank))
        names = [n for n, _ in model.named_parameters()]
        assert opt.names[:opt.n_bucketed] == bucketed(names, lay)  # what checkpoints' zero tables are cut over
        pipe = PipelineSchedule("1f1b", stage, sp) if stage else None
        data = corpus(cfg.vocab_size)
        losses = []
        for step in range(STEPS):
            x, y = batch(data, "train", SEED, step, groups.dp_rank, dp, BATCH, cfg.block_size)
            mbs = list(zip(x.chunk(2), y.chunk(2))) if pipe else [(x, y)]
            losses.append(train_step(model, opt, mbs, groups, step, HYPER, schedule=pipe).loss)
        assert_table_holds(model, opt, cfg, Layout(tp, pp=pp, dp=dp, ep=ep, etp=etp, zero=zero), rank)
        kept = ({n: p.shape[0] for n, p in model.named_parameters()},  # rows held, rows of AdamW state kept
                {n: st["exp_avg"].shape[0] for n, st in opt.named_state().items()})
        early = opt.apart.early if opt.apart is not None else 0  # expert buckets launched from the backward
        out.append((losses, gathered(model, groups, lay), held, kept if not overlap else (kept, early)))
    return out


def one_device_runs(rank, world, init, names):
    return {w: train(moe_config(w), ProcessGroups(Layout(1, dp=1), 0, None, None), False, plain=True)
            for w in names}


# (router, tp, pp, dp, ep, etp, sequence parallel, zero), by world size: one spawn each
RUNS = {2: [("mixtral", 1, 1, 2, 2, None, False, 0), ("deepseek", 1, 1, 2, 2, None, False, 0),
            ("dropping", 1, 1, 2, 2, None, False, 0), ("deepseek", 1, 1, 2, 2, None, False, 1)],
        4: [("mixtral", 1, 1, 4, 4, None, False, 0), ("mixtral", 2, 1, 2, 2, 1, False, 0),
            ("deepseek", 2, 1, 2, 2, 1, True, 0), ("mixtral", 2, 1, 2, 2, 2, True, 0),
            ("deepseek", 2, 1, 2, 2, None, False, 0),  # etp unset: tp
            ("mixtral", 1, 2, 2, 2, None, False, 0),  # PP=2 x DP=2 x EP=2
            ("mixtral", 2, 1, 2, 2, 1, False, 1), ("mixtral", 1, 1, 4, 2, None, False, 1)]}


@pytest.fixture(scope="module")
def references():
    return run_ranks(1, one_device_runs, ["mixtral", "deepseek", "dropping"])[0]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_experts_over_ranks_train_like_one_device(world, references):
    per_rank = run_ranks(world, train_runs, RUNS[world], timeout_s=600)
    for i, (which, tp, pp, dp, ep, etp, sp, zero) in enumerate(RUNS[world]):
        name = f"{which} {Layout(tp, pp=pp, dp=dp, ep=ep, etp=etp, zero=zero)} sp={sp}"
        ref_losses, ref_state = references[which]
        per_layer = moe_config(which).moe.n_experts // ep
        state = {}
        for rank in range(world):
            losses, part, held, kept = per_rank[rank][i]
            assert len(held) == per_layer, f"{name}: rank {rank} holds experts {held}"
            if zero:  # its rows of the dense weights' AdamW state, and of its experts' cut over expert-DP
                local, kept = kept
                experts = [n for n in local if is_expert_weight(n)]
                if Layout(tp, pp=pp, dp=dp, ep=ep, etp=etp, zero=zero).sharded_experts:
                    assert 0 < sum(kept.get(n, 0) for n in experts) < sum(local[n] for n in experts), name
                else:
                    assert all(kept.get(n) == local[n] for n in experts), name
                dense = [n for n in local if not is_expert_weight(n) and not n.endswith("expert_bias")]
                assert sum(kept.get(n, 0) for n in dense) < sum(local[n] for n in dense), name
            rel = np.abs(np.array(losses) - ref_losses) / np.abs(ref_losses)
            assert rel.max() < 1e-5, f"{name}: rank {rank}'s loss differs from one device by {rel.max():.2e}"
            state.update(part)
        assert state.keys() == ref_state.keys(), f"{name}: {sorted(set(state) ^ set(ref_state))[:4]}"
        for k, want in ref_state.items():
            diff = float((state[k] - want).abs().max())
            assert diff < WEIGHTS_TOL, f"{name}: final {k} differs by {diff:.2e}"





def test_expert_gradients_reduced_during_the_backward_pass_take_the_same_steps():
    """TP=2 with whole experts on each TP rank (etp 1: an expert-DP group of 2): with overlap each expert bucket
    is reduced over expert-DP from the backward pass (GradBuckets armed on that group), bit for bit as without."""
    run = [("mixtral", 2, 1, 1, 1, 1, False, 0)]
    plain = run_ranks(2, train_runs, run)
    overlapped = run_ranks(2, train_runs, run, True)
    for rank in range(2):
        losses, state, _, _ = plain[rank][0]
        losses_o, state_o, _, (_, early) = overlapped[rank][0]
        assert early > 0, f"rank {rank}: no expert bucket was reduced from the backward pass"
        assert losses_o == losses, f"rank {rank}: overlap changed a step"
        for k, t in state.items():
            assert torch.equal(t, state_o[k]), f"rank {rank}: final {k} differs with overlap"
