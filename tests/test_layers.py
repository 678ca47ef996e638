"""Each parallel layer, forward and backward, equals its one-device counterpart at TP=2 and TP=4."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from raytp.parallel import comm
from raytp.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                   vocab_parallel_cross_entropy)
from raytp.parallel.placements import Shard
from raytp.parallel.sharding import shard_tensor
from raytp.parallel.spawn import run_ranks

B, T, C, H, V = 2, 8, 16, 24, 257  # V=257 divides neither 2 nor 4: padding is exercised


def _err(a, b):
    return float((a - b).detach().abs().max())


def _seq(t, rank, n):
    return t.chunk(n, dim=1)[rank]


def _last(t, rank, n):
    return t.chunk(n, dim=-1)[rank]


def check_layers(rank, world, init):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    errs = {}
    x = torch.randn(B, T, C)
    lin1, lin2 = nn.Linear(C, H), nn.Linear(H, C)
    gy1, gy2 = torch.randn(B, T, H), torch.randn(B, T, C)

    # Reference: X -> Linear(C, H) -> Linear(H, C) on one device.
    xr = x.clone().requires_grad_()
    h_ref = lin1(xr)
    h_ref.backward(gy1)
    hr = h_ref.detach().clone().requires_grad_()
    y_ref = lin2(hr)
    y_ref.backward(gy2)

    for sp in (False, True):
        col = ColumnParallelLinear(shard_tensor(lin1.weight, Shard(0), rank, world),
                                   shard_tensor(lin1.bias, Shard(0), rank, world), group, sp)
        row = RowParallelLinear(shard_tensor(lin2.weight, Shard(1), rank, world),
                                lin2.bias.detach().clone(), group, sp)
        xin = (_seq(x, rank, world) if sp else x).clone().requires_grad_()
        h = col(xin)
        h.backward(_last(gy1, rank, world))
        tag = "sp" if sp else "tp"
        errs[f"column.{tag}.out"] = _err(h, _last(h_ref, rank, world))
        errs[f"column.{tag}.dx"] = _err(xin.grad, _seq(xr.grad, rank, world) if sp else xr.grad)
        errs[f"column.{tag}.dw"] = _err(col.weight.grad, lin1.weight.grad.chunk(world, 0)[rank])
        errs[f"column.{tag}.db"] = _err(col.bias.grad, lin1.bias.grad.chunk(world, 0)[rank])

        hin = _last(hr.detach(), rank, world).clone().requires_grad_()
        y = row(hin)
        y.backward(_seq(gy2, rank, world) if sp else gy2)
        errs[f"row.{tag}.out"] = _err(y, _seq(y_ref, rank, world) if sp else y_ref)
        errs[f"row.{tag}.dx"] = _err(hin.grad, _last(hr.grad, rank, world))
        errs[f"row.{tag}.dw"] = _err(row.weight.grad, lin2.weight.grad.chunk(world, 1)[rank])
        bias_grad = row.bias.grad.clone()
        if sp:  # each rank saw only its slice of the sequence: the step sums these over TP
            dist.all_reduce(bias_grad, group=group)
        errs[f"row.{tag}.db"] = _err(bias_grad, lin2.bias.grad)

        # Embedding over a padded, split vocabulary.
        emb = nn.Embedding(V, C)
        idx = torch.randint(V, (B, T))
        idx[0, 0] = V - 1  # the last real token lives on the last rank, beside the padding
        out_ref = emb(idx)
        g_out = torch.randn_like(out_ref)
        out_ref.backward(g_out)
        w = shard_tensor(emb.weight, Shard(0, pad=True), rank, world)
        pemb = VocabParallelEmbedding(w, rank * w.shape[0], group, sp)
        out = pemb(idx)
        out.backward(_seq(g_out, rank, world) if sp else g_out)
        errs[f"embedding.{tag}.out"] = _err(out, _seq(out_ref, rank, world) if sp else out_ref)
        ref_wgrad = shard_tensor(emb.weight.grad, Shard(0, pad=True), rank, world)
        errs[f"embedding.{tag}.dw"] = _err(pemb.weight.grad, ref_wgrad)

    # Cross entropy over vocab-split logits (with ignored targets and padded columns).
    logits = torch.randn(B * T, V, requires_grad=True)
    targets = torch.randint(V, (B * T,))
    targets[0], targets[1] = -1, V - 1
    ref = F.cross_entropy(logits, targets, ignore_index=-1)
    ref.backward()
    local = shard_tensor(logits.detach(), Shard(1, pad=True), rank, world)
    start = rank * local.shape[1]
    if start + local.shape[1] > V:  # padded columns hold garbage on purpose: they must get no mass
        local[:, max(V - start, 0):] = 1e4
    local.requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, start, V, group)
    loss.backward()
    errs["cross_entropy.loss"] = _err(loss, ref)
    ref_grad = shard_tensor(logits.grad, Shard(1, pad=True), rank, world)
    errs["cross_entropy.dlogits"] = _err(local.grad, ref_grad)

    # gather/scatter along the last dim are each other's inverse, values and gradients.
    z = torch.randn(B, T, H, requires_grad=True)
    zl = comm.scatter_last(z, group)
    zl.backward(torch.ones_like(zl) * (rank + 1))
    full = comm.gather_last(zl.detach().requires_grad_(), group)
    errs["scatter_last.out"] = _err(zl, _last(z, rank, world))
    errs["gather_last.out"] = _err(full, z)
    expect = torch.cat([torch.full((B, T, H // world), float(r + 1)) for r in range(world)], -1)
    errs["scatter_last.dx"] = _err(z.grad, expect)
    return errs


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_parallel_layers_match_one_device(tp):
    results = run_ranks(tp, check_layers)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    bad = {k: v for k, v in worst.items() if not v < 1e-5}
    assert not bad, f"layers differ from one device at TP={tp}: {bad}"
    assert len(worst) == 25  # every check above ran on every rank
