"""Layout(tp, pp=, dp=): pure rank arithmetic, no processes."""
import pytest

from raytp.parallel.layout import Coords, Layout


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 1), (2, 1, 1), (1, 1, 3), (2, 1, 2), (4, 1, 2), (8, 1, 3),
                                        (2, 2, 1), (2, 3, 2), (1, 4, 2), (4, 2, 3)])
def test_rank_coords_round_trip_and_groups_partition(tp, pp, dp):
    lay = Layout(tp, pp=pp, dp=dp)
    assert lay.world_size == tp * pp * dp and lay.replica_size == tp * pp
    coords = [lay.coords(r) for r in range(lay.world_size)]
    assert [lay.rank(tp=c.tp, pp=c.pp, dp=c.dp) for c in coords] == list(range(lay.world_size))
    for groups, size in ((lay.tp_groups(), tp), (lay.pp_groups(), pp), (lay.dp_groups(), dp)):
        members = sorted(r for g in groups for r in g)
        assert members == list(range(lay.world_size)) and all(len(g) == size for g in groups)
    # Groups of different kinds meet in at most one rank; a TP group lies inside one (stage, replica).
    for a, b in ((lay.tp_groups(), lay.dp_groups()), (lay.tp_groups(), lay.pp_groups()),
                 (lay.pp_groups(), lay.dp_groups())):
        assert all(len(set(x) & set(y)) <= 1 for x in a for y in b)
    for g in lay.tp_groups():
        assert len({(lay.coords(r).pp, lay.coords(r).dp) for r in g}) == 1
    # A replica is its stages' TP groups, contiguous.
    for d in range(dp):
        assert lay.replica(d) == [r for s in range(pp) for r in lay.tp_group(d, s)]


def test_rank_order_is_tp_fastest_then_stage_then_replica():
    lay = Layout(2, pp=2, dp=2)
    assert [(c.tp, c.pp, c.dp) for c in map(lay.coords, range(8))] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    assert lay.tp_group(1, 1) == [6, 7] and lay.pp_group(1, 0) == [1, 3] and lay.dp_group(0, 1) == [2, 6]
    assert str(lay) == "TP=2 x PP=2 x DP=2"


def test_tp_groups_are_contiguous_and_dp_groups_stride():
    lay = Layout(4, dp=2)
    assert lay.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(6) == Coords(tp=2, pp=0, dp=1) and str(lay) == "TP=4 x DP=2"


def test_coordinates_are_named_not_positional():
    """Indexing a rank's coordinates by position (what breaks silently when a dimension is added) fails."""
    with pytest.raises(TypeError):
        Layout(2, dp=2).coords(3)[0]
    with pytest.raises(TypeError):
        Layout(2, 2)  # the degrees after tp are keywords
    with pytest.raises(TypeError):
        Layout(2, dp=2).rank(1, 0)


@pytest.mark.parametrize("bad", [dict(tp=0), dict(tp=2, dp=-1), dict(tp=1.5), dict(tp=True), dict(tp=2, pp=0)])
def test_invalid_degrees_are_rejected(bad):
    with pytest.raises(ValueError, match="positive integer"):
        Layout(**bad)


def test_out_of_range_ranks_are_rejected():
    with pytest.raises(ValueError, match="rank 4 outside world of 4"):
        Layout(2, dp=2).coords(4)
    with pytest.raises(ValueError):
        Layout(2, dp=2).rank(tp=0, dp=2)
    with pytest.raises(ValueError):
        Layout(2, dp=2).replica(2)
