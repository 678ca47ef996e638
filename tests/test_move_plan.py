"""The state mover's planner and its export and fill (raytp.moves), Ray-free, over random (old layout, new
layout, lost ranks) cases.

Each case builds a small model's state as numbered tensors, cuts each old rank's shard of it with the
functions the shards are built by (``shard_tensor``, the distributed optimizer's row cut, the EP place), runs
the plan from those shards into empty new ones (each source's one export, each destination's one fill), and
checks: every element of the new state is
written exactly once and equals the one-device value; a block with a live holder never comes from a snapshot
or a checkpoint; the bytes that leave a process are exactly those its new rank did not hold already (so a
DP grow at zero 0 moves only the new replicas' bytes, a recovery only the lost ranks'); a plan with no
live source names the snapshot or the checkpoint, or is refused when neither holds the bytes.
"""
import itertools
import random

import numpy as np
import pytest
import torch
from tp_training import moe_config

from raytp.models.moe.plan import ExpertPlace
from raytp.moves.execute import export, fill
from raytp.moves.planner import SourceKind, Unplannable, World, moved_bytes, plan_moves
from raytp.moves.regions import overlap
from raytp.moves.table import MOMENTS, Param, StateTable, model_table
from raytp.parallel.layout import Layout
from raytp.parallel.placements import Shard
from raytp.parallel.sharding import shard_tensor
from raytp.parallel.zero_plan import owned_rows, plan
from raytp.tp_degrees import kv_fits

def model(rng):
    """A small Llama-like model's parameters (MoE or dense, tied or not) and its stage cut by pp."""
    head, n_head = 2, rng.choice([4, 8])
    kv = rng.choice([h for h in (1, 2, 4, n_head) if n_head % h == 0])
    d, f, vocab, n_layer = head * n_head, rng.choice([8, 16]), rng.choice([29, 32]), rng.randint(1, 2)
    experts = rng.choice([0, 2, 4])
    first = [Param("embed", (vocab, d), Shard(0, pad=True))]
    blocks = []
    for L in range(n_layer):
        p = f"layers.{L}."
        layer = [Param(p + "q", (d, d), Shard(0)), Param(p + "kv", (kv * head, d), Shard(0, heads=kv)),
                 Param(p + "o", (d, d), Shard(1)), Param(p + "norm", (d,))]
        if experts:
            layer += [Param(p + "router", (experts, d)), Param(p + "expert_bias", (experts,), trained=False)]
            for j in range(experts):
                layer += [Param(p + f"experts.{j}.w13", (2 * f, d), Shard(0, parts=2), j, experts),
                          Param(p + f"experts.{j}.w2", (d, f), Shard(1), j, experts)]
        else:
            layer += [Param(p + "w13", (2 * f, d), Shard(0, parts=2)), Param(p + "w2", (d, f), Shard(1))]
        blocks.append(layer)
    tied = rng.random() < 0.5
    last = [Param("norm_f", (d,))] + ([] if tied else [Param("head", (vocab, d), Shard(0, pad=True))])

    def stages(pp):
        cut = np.array_split(np.arange(n_layer), pp)
        out = []
        for s, layers in enumerate(cut):
            names = [p.name for p in first] if s == 0 else []
            names += [p.name for L in layers for p in blocks[L]]
            if s == pp - 1:
                names += [p.name for p in last] + (["embed"] if tied and pp > 1 else [])
            out.append(names)
        return out

    params = first + [p for b in blocks for p in b] + last
    facts = {"n_head": n_head, "kv": kv, "f": f, "n_layer": n_layer, "experts": experts}
    return StateTable(params, stages, bucket_numel=rng.choice([64, 300, 10 ** 6])), facts


def layouts(facts):
    """Every layout of up to 8 ranks the model allows."""
    out = []
    experts = facts["experts"]
    for tp, pp, dp, cp, zero, ep, etp in itertools.product(
            (1, 2, 4), range(1, min(facts["n_layer"], 2) + 1), (1, 2, 3, 4), (1, 2), (0, 1),
            (1, 2, 4) if experts else (1,), (None, 1) if experts else (None,)):
        if facts["n_head"] % tp or facts["f"] % tp or not kv_fits(facts["kv"], tp) or tp * pp * dp * cp > 8:
            continue
        if ep > max(experts, 1) or (experts and experts % ep):
            continue
        try:
            out.append(Layout(tp, pp=pp, dp=dp, zero=zero, ep=ep, etp=etp, cp=cp))
        except ValueError:
            pass
    return out


def full_state(table):
    """key -> the one-device tensor: numbered elements, distinct across keys."""
    out, at = {}, 1
    for p in table.params:
        n = int(np.prod(p.shape))
        out[f"model/{p.name}"] = torch.arange(at, at + n, dtype=torch.float64).reshape(p.shape)
        at += n
        for k in MOMENTS:
            out[f"optim/{p.name}/{k}"] = torch.arange(at, at + n, dtype=torch.float64).reshape(p.shape)
            at += n
        out[f"optim/{p.name}/step"] = torch.tensor(float(at))
        at += 1
    return out


def shards(table, layout, full):
    """For each rank: key -> its local tensor, cut as the workers cut it (independent of the table's regions)."""
    by_name = {p.name: p for p in table.params}
    out = []
    for r in range(layout.world_size):
        c = layout.coords(r)
        names = table.stages(layout.pp)[c.pp]
        local, weights = {}, {}
        for n in names:
            p = by_name[n]
            if p.expert is not None and layout.experts_split:
                if not ExpertPlace(ep=layout.ep, ep_rank=layout.coord(r, "ep")).holds(p.expert, p.n_experts):
                    continue
                degree, place = layout.expert_tp, layout.coord(r, "etp")
            else:
                degree, place = layout.tp, c.tp
            weights[n] = lambda t, p=p, degree=degree, place=place: shard_tensor(t, p.split, place, degree)
            local[f"model/{n}"] = weights[n](full[f"model/{n}"])
        trained = [by_name[n] for n in names if by_name[n].trained and n in weights]
        split = layout.experts_split
        for group, degree, place, sharded in (
                ([p for p in trained if not (split and p.expert is not None)], layout.dp * layout.cp,
                 c.dp * layout.cp + c.cp, layout.sharded_optimizer),  # rows over DP x CP (Megatron's cut)
                ([p for p in trained if split and p.expert is not None], layout.degree("edp"), layout.coord(r, "edp"),
                 layout.sharded_experts)):
            shapes = [tuple(local[f"model/{p.name}"].shape) for p in group]
            rows = owned_rows(plan(shapes, degree, table.bucket_numel), place) if sharded else None
            for i, p in enumerate(group):
                if rows is not None and i not in rows:
                    continue
                for k in MOMENTS:
                    t = weights[p.name](full[f"optim/{p.name}/{k}"])
                    local[f"optim/{p.name}/{k}"] = t[rows[i][0]:rows[i][1]] if rows is not None else t
                local[f"optim/{p.name}/step"] = full[f"optim/{p.name}/step"]
        out.append(local)
    return out


def world(rng, old, new):
    """Random survivors, the processes new ranks run in, nodes of 4 ranks, snapshots and a checkpoint."""
    kind = rng.choice(["all", "lost", "lost", "many"])
    ranks = list(range(old.world_size))
    most = max(1, len(ranks) // (1 if kind == "many" else 2))
    lost = set() if kind == "all" else set(rng.sample(ranks, rng.randint(1, most)))
    alive = [r for r in ranks if r not in lost]
    if rng.random() < 0.6:  # survivors keep their rank numbers where the new world has them
        process_of = {r: r for r in alive if r < new.world_size}
    else:
        pool = alive[:]
        rng.shuffle(pool)
        process_of = dict(zip(rng.sample(range(new.world_size), min(len(pool), new.world_size)), pool))
    old_nodes = {r: f"n{r // 4}" for r in ranks}
    new_nodes = {j: old_nodes[process_of[j]] if j in process_of else f"n{rng.randint(0, 4)}"
                 for j in range(new.world_size)}
    snapshot = frozenset(r for r in ranks if rng.random() < 0.7) if rng.random() < 0.6 else frozenset()
    return World(frozenset(alive), process_of, old_nodes, new_nodes, snapshot, rng.random() < 0.5)


def _global(region, box_at, size):
    """The global intervals a box at local `box_at` covers, per dim."""
    out = []
    for d, (at0, n) in enumerate(zip(box_at, size)):
        ivs = []
        for a, b, at in region.local(d):
            lo, hi = max(at0, at), min(at0 + n, at + b - a)
            if hi > lo:
                ivs.append((a + lo - at, a + hi - at))
        out.append(ivs)
    return out


def _holds_any(region, glob):
    """Whether `region` holds any element of the product of `glob`'s intervals."""
    return all(any(max(a, c) < min(b, e) for a, b in region.dims[d] for c, e in glob[d]) for d in range(len(glob)))


def _paint(region, arr):
    for combo in itertools.product(*region.dims):
        arr[tuple(slice(a, b) for a, b in combo)] = True


def _covered(region, sources, shape):
    """Whether every element of `region` lies in some region of `sources` (global coordinates)."""
    have, want = np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool)
    for r in sources:
        _paint(r, have)
    _paint(region, want)
    return bool(np.all(have[want]))


def check(table, old, new, w, full):
    before, after = shards(table, old, full), shards(table, new, full)
    held_old, held_new = table.held(old), table.held(new)
    for r, h in enumerate(held_new):  # the table's shapes are the workers'
        assert {k: v.shape for k, v in h.items()} == {k: tuple(t.shape) for k, t in after[r].items()}
    try:
        moves = plan_moves(table, old, new, w)
    except Unplannable:
        reachable = set(w.alive) | set(w.snapshot)
        if w.checkpoint:
            pytest.fail("refused with a checkpoint there")
        assert not all(_covered(h.region, [held_old[i][key].region for i in reachable if key in held_old[i]],
                                full[key].shape) for h_new in held_new for key, h in h_new.items()), \
            "refused though every element had a source"
        return None
    got = [{k: torch.zeros_like(t) for k, t in a.items()} for a in after]
    count = [{k: torch.zeros(t.shape, dtype=torch.int32) for k, t in a.items()} for a in after]
    for m in moves:
        src = before[m.source.rank][m.key]
        if m.source.kind is SourceKind.LIVE:
            assert m.source.rank in w.alive
        else:  # a snapshot or the checkpoint only where no live rank holds the block
            glob = _global(held_new[m.dst][m.key].region, m.box.b_at, m.box.size)
            assert not [i for i in w.alive if m.key in held_old[i] and _holds_any(held_old[i][m.key].region, glob)]
            assert m.source.kind is SourceKind.CHECKPOINT or m.source.rank in w.snapshot
        assert src.shape == held_old[m.source.rank][m.key].shape
        count[m.dst][m.key][tuple(slice(s, s + n) for s, n in zip(m.box.b_at, m.box.size))] += 1
        assert m.in_place == (m.source.kind is SourceKind.LIVE and w.process_of.get(m.dst) == m.source.rank)
    sent = {}  # what each source exports, by destination (a snapshot's or checkpoint's part: the old rank's)
    for source in {m.source for m in moves}:
        for dst, bundle in export(before[source.rank], [m for m in moves if m.source == source]).items():
            sent.setdefault(dst, []).append(bundle)
    for j in range(new.world_size):
        own = before[w.process_of[j]] if j in w.process_of else {}
        mine = [m for m in moves if m.dst == j]
        if not mine:  # the same layout, its own live process holding all of it: nothing to do
            assert old == new and w.process_of.get(j) in w.alive and held_old[w.process_of[j]] == held_new[j], j
            got[j] = {k: t.clone() for k, t in own.items()}
            for k, t in count[j].items():  # each element of its region once (padding stays unwritten)
                t[tuple(slice(0, n) for n in held_new[j][k].region.shape)] = 1
            continue
        fill(got[j], own, mine, sent.get(j, []))
    need = 0
    for j in range(new.world_size):
        mine = held_old[w.process_of[j]] if j in w.process_of else {}
        for key, t in after[j].items():
            real = torch.zeros(t.shape, dtype=torch.int32)
            real[tuple(slice(0, n) for n in held_new[j][key].region.shape)] = 1  # padding stays unwritten
            assert torch.equal(count[j][key], real), (key, j)
            assert torch.equal(got[j][key], t), (key, j)
            # bytes a move must bring: those of the new region its own process did not hold
            new_region = held_new[j][key].region
            kept = 0
            if key in mine:
                kept = sum(b.numel for b in overlap(mine[key].region, new_region))
            need += (new_region.numel - kept) * held_new[j][key].itemsize
    assert moved_bytes(moves) == need
    return moves


@pytest.mark.parametrize("block, cases", [(0, 40)] + [pytest.param(b, 120, marks=pytest.mark.slow) for b in (1, 2, 3, 4)])
def test_random_layout_changes_and_recoveries_rebuild_the_state_exactly_once(block, cases):
    """520 cases in all (40 in the quick tier): tp 1, 2, 4; cp 1, 2; pp 1, 2; dp 1-4; zero 0, 1; ep 1, 2, 4; etp 1
    or tp."""
    rng = random.Random(f"moves-{block}")
    seen = set()
    for _ in range(cases):
        table, facts = model(rng)
        choices = layouts(facts)
        old = rng.choice(choices)
        new = old if rng.random() < 0.3 else rng.choice(choices)
        moves = check(table, old, new, world(rng, old, new), full_state(table))
        seen |= {"refused"} if moves is None else {m.source.kind.value for m in moves}
        seen |= {"zero 1 re-cut"} if old != new and (old.sharded_optimizer or new.sharded_optimizer) else set()
        seen |= {"ep change"} if old.ep != new.ep else set()
        seen |= {"pp change"} if old.pp != new.pp else set()
        seen |= {"cp change"} if old.cp != new.cp else set()
    assert seen == {"live", "snapshot", "checkpoint", "refused", "zero 1 re-cut", "ep change", "pp change",
                    "cp change"}


def test_a_dp_grow_at_zero_0_moves_only_the_new_replicas_bytes():
    rng = random.Random("grow")
    table, _ = model(rng)
    old, new = Layout(2, dp=2), Layout(2, dp=4)
    w = World(frozenset(range(4)), {r: r for r in range(4)})
    moves = check(table, old, new, w, full_state(table))
    assert {m.dst for m in moves if not m.in_place} == {4, 5, 6, 7}
    assert moved_bytes(moves) == sum(h.region.numel * h.itemsize for r in (4, 5, 6, 7) for h in table.held(new)[r].values())


def test_a_recovery_with_a_live_replica_moves_only_the_lost_ranks_bytes_and_from_the_nearest():
    rng = random.Random("recover")
    table, _ = model(rng)
    lay = Layout(2, dp=3)
    nodes = {0: "a", 1: "a", 2: "b", 3: "b", 4: "b", 5: "c"}  # rank 2's twins: rank 0 on a, rank 4 on b
    w = World(frozenset({0, 1, 3, 4, 5}), {r: r for r in (0, 1, 3, 4, 5)}, nodes, {**nodes, 2: "b"})
    moves = check(table, lay, lay, w, full_state(table))
    away = [m for m in moves if not m.in_place]
    assert {m.dst for m in away} == {2} and {nodes[m.source.rank] for m in away} == {"b"}  # from its node only
    assert moved_bytes(moves) == sum(h.region.numel * h.itemsize for h in table.held(lay)[2].values())


def test_zero_1_state_with_no_live_holder_comes_from_the_snapshot_or_the_checkpoint_or_is_refused():
    rng = random.Random("zero1")
    table, _ = model(rng)
    lay = Layout(1, dp=2, zero=1)
    lost = World(frozenset({0}), {0: 0})
    with pytest.raises(Unplannable, match="no snapshot"):
        plan_moves(table, lay, lay, lost)
    for w, kind in ((World(frozenset({0}), {0: 0}, snapshot=frozenset({1})), SourceKind.SNAPSHOT),
                    (World(frozenset({0}), {0: 0}, checkpoint=True), SourceKind.CHECKPOINT)):
        moves = check(table, lay, lay, w, full_state(table))
        optim = {m.source.kind for m in moves if m.dst == 1 and m.key.startswith("optim/") and not m.key.endswith("/step")}
        assert optim == {kind}  # rank 1's rows of the moments were its alone
        assert {m.source.kind for m in moves if m.dst == 1 and m.key.startswith("model/")} == {SourceKind.LIVE}


def gained(old, new, cfg):
    """{new rank: {expert: the old ranks its weights come from}} of a live EP change (every process kept), at
    zero 0 (zero 1's re-cut rows: the random cases)."""
    moves = plan_moves(model_table(cfg), old, new, World(frozenset(range(old.world_size)),
                                                         {r: r for r in range(new.world_size)}))
    out = {r: {} for r in range(new.world_size)}
    for m in moves:
        if not m.in_place:
            assert ".experts." in m.key, m.key  # dense weights and their AdamW state stay where they are
            if m.key.startswith("model/"):  # (a step count comes from any holder of that expert)
                out[m.dst].setdefault(int(m.key.split(".experts.")[1].split(".")[0]), set()).add(m.source.rank)
    return out


def test_an_ep_change_moves_only_the_experts_each_rank_gains_from_holders_of_the_same_slice():
    cfg = moe_config("mixtral")  # 4 experts
    one, two = Layout(1, dp=2, ep=1), Layout(1, dp=2, ep=2)
    assert gained(two, one, cfg) == {0: {2: {1}, 3: {1}}, 1: {0: {0}, 1: {0}}}
    assert gained(one, two, cfg) == {0: {}, 1: {}}
    # experts split over TP (etp 2): a slice comes from the old holder at the same TP rank
    assert gained(Layout(2, dp=2, ep=2), Layout(2, dp=2, ep=1), cfg) == {
        0: {2: {2}, 3: {2}}, 1: {2: {3}, 3: {3}}, 2: {0: {0}, 1: {0}}, 3: {0: {1}, 1: {1}}}
    # DP=4 (EP=2: ranks 0, 2 hold experts 0-1, ranks 1, 3 experts 2-3; EP=4: rank r expert r): the sending is
    # shared by the holders
    assert gained(Layout(1, dp=4, ep=2), Layout(1, dp=4, ep=4), cfg) == {0: {}, 1: {1: {0, 2}}, 2: {2: {1, 3}}, 3: {}}
    assert gained(Layout(1, dp=4, ep=4), Layout(1, dp=4, ep=2), cfg) == {
        0: {1: {1}}, 1: {2: {2}, 3: {3}}, 2: {0: {0}, 1: {1}}, 3: {2: {2}}}
