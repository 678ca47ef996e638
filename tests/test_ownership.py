"""The ownership rule (raytp.moves.owners (a view of the table)): pure, no processes."""
import pytest

from raytp.parallel.layout import Layout
from raytp.moves.owners import Owners


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 1), (2, 1, 2), (4, 1, 3), (2, 2, 2), (1, 3, 2)])
def test_owners_hold_every_part_once_and_holders_share_a_part(tp, pp, dp):
    lay = Layout(tp, pp=pp, dp=dp)
    own = Owners(lay)
    owners = own.owners()
    assert sorted(own.part(r) for r in owners) == list(range(own.parts)) == list(range(tp * pp))
    assert all(own.owns(r) == (r in owners) for r in range(lay.world_size))
    for r in range(lay.world_size):
        holders = own.holders(r)
        assert r in holders and len(holders) == dp
        assert {own.part(h) for h in holders} == {own.part(r)}
        assert own.owner(own.part(r)) in holders and own.owns(own.owner(own.part(r)))
    # The holders of the parts partition the world.
    assert sorted(h for p in range(own.parts) for h in own.holders(own.owner(p))) == list(range(lay.world_size))


def test_part_is_the_tp_rank_without_stages():
    own = Owners(Layout(4, dp=2))
    assert [own.part(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3] and own.owners() == [0, 1, 2, 3]
