"""The distributed optimizer's row ownership (raytp.parallel.zero_plan): pure, no processes."""
from math import prod

import pytest

from raytp.parallel.zero_plan import buckets_of, handover, owned_rows, plan, rows_of

SHAPES = [(50, 8), (8,), (8,), (24, 8), (24,), (8, 24), (8,), (33, 8), (3, 2, 4)]


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bucket", [10_000, 300, 1])
def test_ranges_cover_every_row_once_between_rows_and_balance(dp, bucket):
    buckets = plan(SHAPES, dp, bucket)
    seen = {i: [] for i in range(len(SHAPES))}
    for b in buckets:
        assert len(b.ranges) == dp
        sizes = []
        for pieces in b.ranges:
            at = 0
            for pc in pieces:
                assert pc.at == at and pc.stop > pc.start  # laid out in order, no empty piece
                assert pc.row == rows_of(SHAPES[pc.index])[1]
                at += pc.numel
                seen[pc.index].append((pc.start, pc.stop))
            sizes.append(at)
        assert b.chunk == max(sizes)
        total = sum(prod(SHAPES[i]) for i in b.params)
        widest_row = max(rows_of(SHAPES[i])[1] for i in b.params)
        assert max(sizes) <= total / dp + widest_row  # cut at the row edge nearest the even share
    for i, spans in seen.items():  # every row of every tensor exactly once, in order
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == rows_of(SHAPES[i])[0]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_buckets_are_consecutive_whole_tensors_and_a_large_tensor_stands_alone():
    assert buckets_of(SHAPES, 500) == [[0, 1, 2], [3, 4, 5, 6], [7, 8]]
    assert buckets_of([(1000,), (4,), (4,)], 100) == [[0], [1, 2]]
    assert buckets_of(SHAPES, 10**9) == [list(range(len(SHAPES)))]


def test_a_rank_owns_one_block_per_tensor_and_one_rank_owns_all():
    assert owned_rows(plan(SHAPES, 1), 0) == {i: (0, rows_of(s)[0]) for i, s in enumerate(SHAPES)}
    for d in range(4):
        rows = owned_rows(plan(SHAPES, 4, 10**9), d)
        assert all(0 <= a < b <= rows_of(SHAPES[i])[0] for i, (a, b) in rows.items())


def test_more_ranks_than_rows_leave_some_ranks_empty_but_lose_nothing():
    b = plan([(2, 4)], 4)[0]
    assert sum(pc.numel for r in b.ranges for pc in r) == 8
    assert b.chunk == 4


@pytest.mark.parametrize("old_dp,new_dp", [(4, 2), (2, 4), (3, 5), (4, 1), (1, 3)])
def test_a_dp_resize_hands_every_new_rank_its_rows_each_from_one_old_rank(old_dp, new_dp):
    for bucket in (10**9, 700):
        given = [handover(SHAPES, old_dp, r, new_dp, bucket) for r in range(old_dp)]
        for d in range(new_dp):
            want = owned_rows(plan(SHAPES, new_dp, bucket), d)
            rows = {i: [] for i in want}
            for r in range(old_dp):
                for i, (a, b) in given[r][d].items():
                    old = owned_rows(plan(SHAPES, old_dp, bucket), r)[i]
                    assert old[0] <= a < b <= old[1], "an old rank hands over rows it does not own"
                    rows[i].extend(range(a, b))
            assert {i: sorted(v) for i, v in rows.items()} == {i: list(range(a, b)) for i, (a, b) in want.items()}
