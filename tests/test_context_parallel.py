"""Context parallelism's pieces against one device: the sequence cut (pure) and ring attention over gloo ranks."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytp.parallel.context import sequence as context
from raytp.parallel.spawn import run_ranks


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_cut_pairs_an_early_and_a_late_chunk_and_round_trips(cp):
    T = 4 * cp
    x = torch.arange(2 * T).view(2, T)
    parts = [context.shard(x, cp, r) for r in range(cp)]
    assert torch.equal(context.unshard(parts), x)
    for r in range(cp):
        assert torch.equal(parts[r][0], context.positions(T, cp, r))  # row 0 holds each token's place
    # every rank does the same causal work: the sum of its tokens' visible keys (positions + 1) is equal
    work = {int((context.positions(T, cp, r) + 1).sum()) for r in range(cp)}
    assert len(work) == 1


def test_ulysses_refuses_heads_that_do_not_divide_by_cp():
    from raytp.parallel.context.ulysses import refusal
    assert refusal(8, 4, 4) is None and "KV heads (2)" in refusal(8, 2, 4) and "use ring" in refusal(6, 6, 4)


def test_a_sequence_that_does_not_cut_evenly_is_refused_by_name():
    assert context.refusal(64, 1) is None and context.refusal(64, 4) is None
    assert "must divide by 2 x cp = 8" in context.refusal(60, 4)
    assert "2 x cp x tp = 16" in context.refusal(72, 4, tp=2, sequence_parallel=True)
    assert context.refusal(64, 4, tp=2, sequence_parallel=True) is None
    with pytest.raises(ValueError, match="2 x cp = 6"):
        context.positions(16, 3, 0)


def _inputs(B, H, Hkv, T, d, docs):
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(B, h, T, d, generator=g) for h in (H, Hkv, Hkv, H))
    ids = torch.randint(0, 3, (B, T), generator=g).sort(dim=1).values if docs else None
    return q, k, v, dy, ids


def _reference(B, H, Hkv, T, d, docs):
    """One device: SDPA over the whole sequence, causal (and within each document)."""
    q, k, v, dy, ids = _inputs(B, H, Hkv, T, d, docs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ke, ve = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if ids is not None:
        mask = mask & (ids[:, :, None] == ids[:, None, :])[:, None]
    y = F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)
    y.backward(dy)
    return y.detach(), q.grad, k.grad, v.grad


def _cp_rank(rank, world, init_method, shape, docs, kind):
    from raytp.parallel.context.ring_attention import ring_attention
    from raytp.parallel.context.ulysses import ulysses_attention
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    q, k, v, dy, ids = _inputs(*shape, docs)
    mine = [context.shard(t, world, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    attend = ring_attention if kind == "ring" else ulysses_attention
    y = attend(*mine, None, None if ids is None else context.shard(ids, world, rank, dim=1))
    y.backward(context.shard(dy, world, rank, dim=2))
    return [y.detach()] + [t.grad for t in mine]


@pytest.mark.parametrize("kind, cp, heads, docs", [
    ("ring", 2, (4, 1), True), ("ulysses", 2, (4, 2), False),
    *[pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("ring", 2, (4, 4), False), ("ring", 4, (4, 2), False), ("ring", 3, (2, 2), True), ("ulysses", 4, (8, 4), True))]])
def test_cp_attention_equals_one_device_forward_and_backward(kind, cp, heads, docs):
    """Outputs and the gradients of q, k and v, ring at CP=2, 3 and 4 and Ulysses at 2 and 4, with grouped KV heads
    and packed documents (document ids, causal within each)."""
    shape = (2, heads[0], heads[1], 8 * cp, 16)
    want = _reference(*shape, docs)
    got = run_ranks(cp, _cp_rank, shape, docs, kind)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        whole = context.unshard([r[i] for r in got], dim=2)
        assert torch.allclose(whole, want[i], atol=2e-6, rtol=1e-5), (name, (whole - want[i]).abs().max())


@pytest.mark.parametrize("parallel, model, says", [
    ({"cp": 3}, {}, "must divide by 2 x cp = 6"),
    ({"cp": 2, "tp": 2, "sequence_parallel": True}, {"block_size": 36}, "2 x cp x tp = 8"),
    ({"cp": 2, "cp_attention": "ulysses", "tp": 2}, {"n_head": 4, "n_kv_head": 2, "arch": "llama"}, "KV heads (1)"),
    ({"cp": 2, "pp": 2, "sequence_parallel": True, "tp": 2}, {"block_size": 36}, "2 x cp x tp = 8")])
def test_a_job_at_cp_above_1_is_refused_by_name_before_anything_starts(parallel, model, says):
    from raytp.config import from_dict
    from raytp.config.values import ConfigError
    with pytest.raises(ConfigError, match="parallel.cp") as e:
        from_dict({"model": {"n_layer": 2, "n_head": 4, "block_size": 64, **model}, "parallel": parallel})
    assert says in str(e.value)


def test_a_live_change_at_or_to_cp_above_1_starts_every_worker_of_the_new_layout_anew():
    """A stage that holds CP ranks beside its TP ranks (before or after) cannot grow in place as a TP group does:
    any change there is a restage (every worker started ahead, the state moved by the planner); at cp 1 the kinds
    stay as they were."""
    from raytp.parallel.layout import Layout
    from raytp.runtime.elastic import changes
    for old, new in ((Layout(1, cp=2), Layout(1, cp=4)), (Layout(1, cp=2), Layout(1, cp=2, dp=2)),
                     (Layout(2), Layout(1, cp=2)), (Layout(1, cp=2, pp=2), Layout(1, pp=2))):
        plan = changes.plan_change(old, new)
        assert isinstance(plan, changes.Restage) and plan.ranks.kept == ()
        assert plan.bundles(old, new, lambda q: old.stage_ranks) == [new.stage_ranks] * (new.dp * new.pp)
    assert isinstance(changes.plan_change(Layout(2), Layout(4)), changes.TpChange)
    assert isinstance(changes.plan_change(Layout(2), Layout(2, dp=2)), changes.DpChange)


@pytest.mark.parametrize("causal, docs", [(True, False), (False, True), (True, True)])
def test_a_blocks_fused_cpu_kernel_and_its_plain_softmax_agree(monkeypatch, causal, docs):
    """The two paths of raytp.parallel.context.attention_blocks (CPU's fused flash kernels; the plain softmax other
    devices run, whole and in tiles of query rows), forward and backward, with rows that see no key."""
    from raytp.parallel.context import attention_blocks as blocks
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, 3, 8, 16, generator=g) for _ in range(4))
    mask = None
    if docs:
        ids = torch.randint(0, 3, (2, 8), generator=g)
        mask = (ids[:, :, None] == torch.randint(0, 3, (2, 8), generator=g)[:, None, :])[:, None]
        mask[0, 0, 0] = False  # a row that sees nothing
    got, big = {}, blocks.TILE
    for fused, tile in ((True, big), (False, big), (False, 3)):  # 3: the plain block in 3 tiles
        monkeypatch.setattr(blocks, "_fused", lambda t, f=fused: f)
        monkeypatch.setattr(blocks, "TILE", tile)
        o, lse = blocks.forward(q, k, v, causal, mask, 0.25)
        whole = torch.where(lse.isinf(), 0.0, lse)  # as a backward's final lse would be: finite
        delta = (do * o).sum(-1)
        got[fused, tile] = (o, lse, *blocks.backward(do, q, k, v, o, whole, delta, causal, mask, 0.25))
    for a, b, c in zip(got[True, big], got[False, big], got[False, 3]):
        assert torch.allclose(a, b, atol=1e-5, equal_nan=False), (a - b).abs().max()
        assert torch.allclose(c, b, atol=1e-6, equal_nan=False), (c - b).abs().max()  # tiles: the same numbers
