"""Context parallelism with Mixture-of-Experts layers trains like one device, in-process over gloo (no Ray): the
Mixtral-style router (balance and z losses), the DeepSeek-style one (selection bias, shared expert) and a
capacity that drops choices, at CP=2 alone and with experts spread over the CP ranks (CP=2 x EP=2), and with TP
and zero 1 in the slow tier; 20 AdamW steps, losses within 1e-5 relative and the final weights (every expert
gathered from where it lives) within test_moe_tp's bound. The balance loss and the capacity are per sequence:
their counts and sums come from every CP rank's part of it (raytp.parallel.context.sequence_sum), the bias's
loads from every replica and CP rank."""
import numpy as np
import pytest
import torch.distributed as dist
from tp_training import BATCH, HYPER, SEED, STEPS, WEIGHTS_TOL, corpus, gathered, moe_config, train

from raytp.data.corpus import batch
from raytp.models.documents import context_share
from raytp.models.moe.plan import ExpertPlace
from raytp.models.registry import is_expert_weight
from raytp.models.shard import build_shard
from raytp.parallel.context import context_attention
from raytp.parallel.groups import ProcessGroups, build_groups
from raytp.parallel.layout import Layout
from raytp.parallel.spawn import run_ranks
from raytp.train.optimizer import make_optimizer
from raytp.train.row_cut import experts_cut
from raytp.train.step import train_step


def _train(rank, world, init, runs):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out = []
    for which, tp, cp, dp, ep, etp, zero, kind in runs:
        cfg, lay = moe_config(which), Layout(tp, cp=cp, dp=dp, ep=ep, etp=etp, zero=zero)
        groups = build_groups(lay, rank)
        model = build_shard(cfg, SEED, groups.tp, experts=ExpertPlace.of(groups))
        context_attention.bind(model, groups, kind)
        opt = make_optimizer(model, HYPER, lay.grad_degree, groups.grad_rank, zero=zero,
                             apart=is_expert_weight if lay.experts_split else None, **experts_cut(lay, rank))
        data, losses = corpus(cfg.vocab_size), []
        for step in range(STEPS):
            x, y = batch(data, "train", SEED, step, groups.dp_rank, dp, BATCH, cfg.block_size)
            losses.append(train_step(model, opt, [context_share(x, y, None, cp, groups.cp_rank)], groups, step,
                                     HYPER).loss)
        if hasattr(opt, "settle"):
            opt.settle()
        out.append((losses, gathered(model, groups, lay)))
    return out


def _one_device(rank, world, init, names):
    return {w: train(moe_config(w), ProcessGroups(Layout(1), 0, None, None), False, plain=True) for w in names}


# (router, tp, cp, dp, ep, etp, zero, attention), by world size: one spawn each
RUNS = {2: [("mixtral", 1, 2, 1, 1, None, 0, "ring"), ("deepseek", 1, 2, 1, 2, None, 0, "ring"),
            ("dropping", 1, 2, 1, 2, None, 0, "ulysses")],
        4: [("mixtral", 2, 2, 1, 2, 1, 0, "ring"), ("deepseek", 1, 2, 2, 2, None, 1, "ring"),
            ("dropping", 1, 4, 1, 2, None, 0, "ring")]}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_expert_layers_with_context_parallelism_train_like_one_device(world):
    want = run_ranks(1, _one_device, sorted({r[0] for r in RUNS[world]}))[0]
    got = run_ranks(world, _train, RUNS[world], timeout_s=600)
    for i, run in enumerate(RUNS[world]):
        want_losses, want_state = want[run[0]]
        state = {}
        for rank_out in got:
            losses, held = rank_out[i]
            rel = np.abs(np.array(losses) - want_losses) / np.abs(want_losses)
            assert rel.max() < 1e-5, (run, f"loss differs from one device by {rel.max():.2e} relative")
            state.update(held)
        assert set(state) == set(want_state), run
        for k, t in want_state.items():
            diff = (state[k] - t).abs().max().item()
            assert diff < WEIGHTS_TOL, (run, f"final {k} differs by {diff:.2e}")
