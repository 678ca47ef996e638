"""Layout(tp, dp): pure rank arithmetic, no processes."""
import pytest

from raytp.parallel.layout import Layout


@pytest.mark.parametrize("tp, dp", [(1, 1), (2, 1), (1, 3), (2, 2), (4, 2), (8, 3)])
def test_rank_coords_round_trip_and_groups_partition(tp, dp):
    lay = Layout(tp, dp)
    assert lay.world_size == tp * dp
    assert [lay.rank(*lay.coords(r)) for r in range(lay.world_size)] == list(range(lay.world_size))
    for groups, size in ((lay.tp_groups(), tp), (lay.dp_groups(), dp)):
        members = sorted(r for g in groups for r in g)
        assert members == list(range(lay.world_size)) and all(len(g) == size for g in groups)
    # A TP group and a DP group meet in exactly one rank.
    assert all(len(set(t) & set(d)) == 1 for t in lay.tp_groups() for d in lay.dp_groups())


def test_tp_groups_are_contiguous_and_dp_groups_stride():
    lay = Layout(4, 2)
    assert lay.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(6) == (1, 2) and str(lay) == "TP=4 x DP=2"


@pytest.mark.parametrize("bad", [dict(tp=0), dict(tp=2, dp=-1), dict(tp=1.5), dict(tp=True)])
def test_invalid_degrees_are_rejected(bad):
    with pytest.raises(ValueError, match="positive integer"):
        Layout(**bad)


def test_out_of_range_ranks_are_rejected():
    with pytest.raises(ValueError, match="rank 4 outside world of 4"):
        Layout(2, 2).coords(4)
    with pytest.raises(ValueError):
        Layout(2, 2).rank(2, 0)
