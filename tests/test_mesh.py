"""The mesh with an expert axis folded over DP x TP, and the placement table, without Ray or processes."""
import itertools

import pytest

from raytp.parallel.layout import Layout
from raytp.moves.owners import Owners
from raytp.parallel.placements import REPLICATE, ROWS, Shard, TensorPlacement, dense_weight, expert_placement


def test_expert_axes_fold_over_dp_with_etp_equal_to_tp():
    lay = Layout(2, pp=2, dp=4, ep=2, etp=2)
    assert lay.degree("edp") == 2 and str(lay) == "TP=2 x PP=2 x DP=4 x EP=2 (ETP=2)"
    # rank 11: tp 1, stage 1, replica 2; inside its stage ETP is its TP rank, EP and expert-DP split its replica.
    assert (lay.coords(11).tp, lay.coords(11).pp, lay.coords(11).dp) == (1, 1, 2)
    assert [lay.coord(11, a) for a in ("etp", "ep", "edp")] == [1, 0, 1]
    assert lay.group(11, "etp") == lay.group(11, "tp") == [10, 11]
    assert lay.group(11, "ep") == [11, 15] and lay.group(11, "edp") == [3, 11]
    assert lay.group(11, ("etp", "ep")) == [10, 11, 14, 15]


def test_expert_axes_fold_over_tp_first_with_etp_one():
    lay = Layout(2, pp=2, dp=4, ep=4, etp=1)  # etp defaults to tp (Megatron's default too)
    assert lay.degree("etp") == 1 and lay.degree("edp") == 2
    assert [lay.coord(11, a) for a in ("etp", "ep", "edp")] == [0, 1, 1]
    assert lay.group(11, "ep") == [10, 11, 14, 15] and lay.group(11, "edp") == [3, 11]
    assert lay.group(11, "etp") == [11]


@pytest.mark.parametrize("tp, pp, dp, ep, etp, cp", [(1, 1, 4, 2, 1, 1), (2, 1, 2, 2, 2, 1), (2, 2, 4, 4, 1, 1),
                                                     (4, 2, 2, 2, 4, 1), (2, 3, 3, 3, 2, 1), (1, 2, 1, 1, 1, 1),
                                                     (2, 2, 2, 4, 1, 2), (1, 1, 2, 4, 1, 4), (2, 2, 1, 2, 2, 2)])
def test_every_axis_round_trips_and_its_groups_partition_each_stage(tp, pp, dp, ep, etp, cp):
    lay = Layout(tp, pp=pp, dp=dp, ep=ep, etp=etp, cp=cp)
    for r in range(lay.world_size):
        at = {a: lay.coord(r, a) for a in ("etp", "ep", "edp", "pp")}
        assert lay.rank_at(**at) == r
        assert lay.rank_at(**{a: lay.coord(r, a) for a in ("tp", "cp", "pp", "dp")}) == r
    for axes in ("tp", "cp", "pp", "dp", ("dp", "cp"), "etp", "ep", "edp", ("ep", "etp"), ("etp", "ep", "edp")):
        names = (axes,) if isinstance(axes, str) else axes
        size = 1
        for a in names:
            size *= lay.degree(a)
        groups = lay.groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(lay.world_size))
        assert all(len(g) == size for g in groups)
        for g in groups:  # a group is the sub-mesh through any of its members, along the named axes only
            assert all(lay.group(r, axes) == g for r in g)
            mesh = ("tp", "cp", "pp", "dp") if names[0] in ("tp", "cp", "pp", "dp") else ("etp", "ep", "edp", "pp")
            same_mesh = [a for a in mesh if a not in names]
            assert len({tuple(lay.coord(r, a) for a in same_mesh) for r in g}) == 1
    # An expert group never leaves its stage; the expert mesh of a stage is exactly its dp x cp x tp ranks.
    for g in lay.groups(("etp", "ep", "edp")):
        assert len({lay.coords(r).pp for r in g}) == 1 and len(g) == dp * cp * tp


def test_the_cp_axis_lies_between_tp_and_the_stages():
    """Megatron's order, TP innermost: a TP group is contiguous, a stage's CP ranks follow each other within its
    placement's bundles, a replica is contiguous; at cp 1 the ranks are the TP x PP x DP mesh's."""
    lay = Layout(2, cp=2, pp=2, dp=2)
    assert lay.world_size == 16 and lay.replica_size == 8 and str(lay) == "TP=2 x CP=2 x PP=2 x DP=2"
    c = lay.coords(3)
    assert (c.tp, c.cp, c.pp, c.dp) == (1, 1, 0, 0) and lay.rank(tp=1, cp=1, pp=1, dp=1) == 15
    assert lay.group(0, "tp") == [0, 1] and lay.group(0, "cp") == [0, 2] and lay.group(0, "pp") == [0, 4]
    assert lay.group(0, "dp") == [0, 8] and lay.group(5, ("dp", "cp")) == [5, 7, 13, 15]
    assert lay.replica(1) == list(range(8, 16))
    assert [lay.bundle_index(r) for r in lay.replica(1)] == list(range(8))
    assert lay.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert lay.degree("edp") == 4 and Layout(2, cp=2, dp=2, ep=8, etp=1).degree("edp") == 1
    with pytest.raises(ValueError, match="must divide dp x cp x tp"):
        Layout(2, cp=2, ep=8)
    # Dense gradients are summed over DP x CP, and zero 1 cuts the AdamW rows over the same ranks.
    assert lay.grad_degree == 4 and [lay.grad_place(r) for r in (0, 2, 8, 10)] == [0, 1, 2, 3]
    assert Layout(2, cp=2, zero=1).sharded_optimizer and not Layout(2, cp=1, zero=1).sharded_optimizer
    with pytest.raises(ValueError, match="positive integer"):
        Layout(2, cp=0)


@pytest.mark.parametrize("bad, match", [(dict(tp=2, dp=1, ep=4), "must divide"), (dict(tp=4, dp=2, etp=2), "1 or tp"),
                                        (dict(tp=2, ep=0), "positive integer")])
def test_invalid_expert_degrees_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        Layout(**bad)


def test_axes_of_the_two_meshes_do_not_mix():
    lay = Layout(2, dp=2, ep=2)
    with pytest.raises(ValueError, match="mix"):
        lay.group(0, ("tp", "ep"))
    with pytest.raises(ValueError, match="no mesh axis"):
        lay.group(0, "xp")


def test_a_tensor_split_over_two_axes():
    """An expert weight: its experts split over EP (dim 0), each expert's columns over ETP (dim 2),
    replicated over expert-DP; who holds and writes which piece follows from the table alone."""
    lay = Layout(2, pp=2, dp=4, ep=2, etp=2)
    w = expert_placement(Shard(2), expert_dim=0)
    assert w.split_axes == ("etp", "ep") and w.replicated_axes == ("edp",)
    assert w.on("ep") == Shard(0) and w.on("etp") == Shard(2) and w.on("pp") is None and w.on("tp") is None
    assert w.pieces(lay) == 4
    assert w.holders(lay, 11) == [3, 11] and w.writes(lay, 3) and not w.writes(lay, 11)
    # Within a stage, the four pieces are each held by expert-DP ranks, and each has exactly one writer.
    for s in range(lay.pp):
        stage = [r for r in range(lay.world_size) if lay.coords(r).pp == s]
        pieces = {(lay.coord(r, "ep"), lay.coord(r, "etp")) for r in stage}
        assert len(pieces) == 4
        writers = [r for r in stage if w.writes(lay, r)]
        assert sorted((lay.coord(r, "ep"), lay.coord(r, "etp")) for r in writers) == sorted(pieces)


def _same_bytes(lay: Layout, placements, rank: int) -> list[int]:
    """The reference rule: the ranks holding the same bytes of every placement as `rank` (the intersection of
    each placement's holders, TensorPlacement.holders)."""
    return sorted(set.intersection(*(set(p.holders(lay, rank)) for p in placements)))


def _state_placements(lay: Layout) -> list:
    """Every distinct placement of a model's state on `lay`, written out from the mesh's axes (dense weights split
    or not along TP, replicated over DP; their AdamW rows cut over DP under zero 1; experts over EP and ETP,
    replicated over expert-DP, their rows cut over expert-DP under zero 1)."""
    rows = Shard(ROWS) if lay.sharded_optimizer else REPLICATE
    out = [dense_weight(Shard(0)), dense_weight(REPLICATE), TensorPlacement.of(tp=Shard(0), dp=rows),
           TensorPlacement.of(tp=REPLICATE, dp=rows)]
    if lay.experts_split:
        etp = Shard(0) if lay.expert_tp > 1 else REPLICATE
        out += [expert_placement(Shard(0) if lay.expert_tp > 1 else REPLICATE),
                TensorPlacement.of(etp=etp, ep=Shard(0), edp=Shard(ROWS) if lay.sharded_experts else REPLICATE)]
    return out


@pytest.mark.parametrize("tp, pp, dp, ep, etp, zero", [
    (2, 2, 4, 2, 2, 0), (2, 2, 4, 2, 2, 1), (2, 1, 4, 4, 1, 0), (2, 1, 2, 1, 1, 1), (4, 1, 2, 2, 4, 0),
    (1, 3, 4, 2, None, 0), (1, 2, 4, 4, None, 1), (2, 2, 3, 1, None, 0)])
def test_owners_read_from_the_table_are_the_intersection_of_the_placements(tp, pp, dp, ep, etp, zero):
    """raytp.moves.owners (the table's places) answers as the placements' own holder rule does."""
    lay = Layout(tp, pp=pp, dp=dp, ep=ep, etp=etp, zero=zero)
    own, state = Owners(lay), _state_placements(lay)
    weights = state[:2] + state[4:5]
    for r in range(lay.world_size):
        assert own.holders(r) == _same_bytes(lay, state, r)
        assert own.weight_holders(r) == _same_bytes(lay, weights, r)
        assert own.writes_experts(r) == (_same_bytes(lay, state[4:5] if lay.experts_split else weights, r)[0] == r)
    assert own.owners() == sorted({_same_bytes(lay, state, r)[0] for r in range(lay.world_size)})


def test_ownership_of_a_state_with_experts_narrows_to_the_replicas_holding_the_same_experts():
    lay = Layout(2, pp=2, dp=4, ep=2, etp=2)
    own = Owners(lay)
    # Rank 7 holds rank 11's dense shards but other experts: only rank 3 can stand in for 11.
    assert own.holders(11) == [3, 11] and own.owns(3) and not own.owns(11)
    assert own.parts == lay.world_size // 2 and own.part(11) == own.part(3)
    assert own.weight_holders(11) == [3, 11]
    # Rank 7 (replica 1) is the first to hold its experts: it writes them; rank 11's are rank 3's.
    assert own.writes_experts(3) and own.writes_experts(7) and not own.writes_experts(11)


@pytest.mark.parametrize("tp, pp, dp, zero", [(2, 1, 3, 0), (2, 2, 2, 0), (1, 2, 3, 1), (2, 1, 2, 1), (4, 1, 1, 1)])
def test_dense_placements_give_the_ownership_rule(tp, pp, dp, zero):
    """The table's dense rows say what the one-axis rule said: replica 0 owns (zero 0), or every rank its own
    rows (zero 1 with dp > 1); replica 0 writes the weights."""
    lay = Layout(tp, pp=pp, dp=dp, zero=zero)
    own = Owners(lay)
    sharded = zero == 1 and dp > 1
    assert own.owners() == (list(range(lay.world_size)) if sharded else lay.replica(0))
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert own.holders(r) == ([r] if sharded else lay.dp_group(c.tp, c.pp))
        assert own.part(r) == (r if sharded else c.pp * tp + c.tp)
        assert own.writes_weights(r) == (c.dp == 0)
    assert TensorPlacement.of(tp=Shard(0), dp=REPLICATE) == dense_weight(Shard(0))
    assert list(itertools.chain(*lay.groups("dp"))) == [r for g in lay.dp_groups() for r in g]


def test_layers_are_rebound_to_the_group_of_the_axis_they_name_never_guessed():
    """After a recovery or resize every layer gets the group of its own axis; one that names none is an error
    (an expert dispatcher must never be rebound to the TP group by default)."""
    import torch.nn as nn

    from raytp.models.shard import rebind_groups
    from raytp.parallel.groups import ProcessGroups
    from raytp.parallel.layers import RowParallelLinear

    class Dispatch(nn.Module):
        group_axis = "ep"

        def __init__(self):
            super().__init__()
            self.group = None

    model = nn.Sequential(Dispatch(), RowParallelLinear.__new__(RowParallelLinear))
    nn.Module.__init__(model[1])
    model[1].group = None
    groups = ProcessGroups(Layout(2, dp=2, ep=2), 0, tp="tp-group", ep="ep-group")
    rebind_groups(model, groups)
    assert model[0].group == "ep-group" and model[1].group == "tp-group"
    rebind_groups(model, None)
    assert model[0].group is None and model[1].group is None

    class Unnamed(nn.Module):
        def __init__(self):
            super().__init__()
            self.group = None

    with pytest.raises(TypeError, match="names no mesh axis"):
        rebind_groups(nn.Sequential(Unnamed()), groups)
    with pytest.raises(KeyError, match="no process group 'edp'"):
        groups.group("edp")
