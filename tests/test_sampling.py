"""The pure sampling functions (raytp.data.sampling): epoch permutations and blends, without processes."""
from __future__ import annotations

import numpy as np
import pytest

from raytp.data.sampling import blend, permute, step_samples, window_count, windows


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 16, 17, 100, 255, 1000, 4097])
def test_permute_is_a_bijection(n):
    for key in (0, 1, 12345):
        y = permute(np.arange(n), n, key)
        assert sorted(y.tolist()) == list(range(n))


def test_permute_of_a_large_domain_needs_no_table():
    n = 10**12 + 39  # ~10^12 windows: computed, not stored
    i = np.arange(0, n, n // 1000)
    y = permute(i, n, 7)
    assert ((0 <= y) & (y < n)).all() and len(np.unique(y)) == len(i)


def test_permutations_differ_by_key_and_shuffle():
    a, b = permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2)
    assert (a != b).mean() > 0.9
    # not near the identity: few fixed points and a displacement around n/3, as a uniform permutation has
    assert (a == np.arange(1000)).sum() < 10
    assert 250 < np.abs(a - np.arange(1000)).mean() < 420


def test_every_window_once_per_epoch_and_a_new_order_each_epoch():
    n, batch = 97, 8  # a batch spans two epochs at times
    steps = (3 * n) // batch
    seen = np.concatenate([windows(step_samples(s, batch), n, seed=5) for s in range(steps)])
    for e in range(2):
        assert sorted(seen[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert (seen[:n] != seen[n:2 * n]).mean() > 0.9


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_the_global_batch_does_not_depend_on_dp(dp):
    n, batch = 50, 8
    for s in range(20):
        whole = windows(step_samples(s, batch), n, seed=3)
        parts = np.concatenate([windows(step_samples(s, batch, r, dp), n, seed=3) for r in range(dp)])
        assert (whole == parts).all()


def test_window_count():
    assert window_count(1025, 64) == 16 and window_count(1024, 64) == 15 and window_count(10, 64) == 0


def test_two_sources_keep_their_weights_within_one_sample_every_step():
    batch = 8
    counts = []
    for s in range(200):
        src, _ = blend(step_samples(s, batch), [0.7, 0.3])
        counts.append((src == 0).sum())
    assert set(counts) <= {5, 6}  # 0.7 x 8 = 5.6
    assert abs(np.mean(counts) - 5.6) < 0.01  # and 0.7 over the run, not 6/8


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.2, 0.2, 0.1], [3, 1, 1, 1, 2]])
def test_each_source_reads_its_samples_in_order_once(weights):
    k = 5000
    src, idx = blend(np.arange(k), weights)
    share = np.array(weights) / sum(weights)
    for d in range(len(weights)):
        mine = idx[src == d]
        assert (mine == np.arange(len(mine))).all()  # 0, 1, 2, ...: each sample of the source once, in order
        assert abs(len(mine) - share[d] * k) <= 2
    # any prefix keeps the shares within about a sample per level of the tree
    for cut in (7, 64, 333, 4096):
        got = np.bincount(src[:cut], minlength=len(weights))
        assert np.abs(got - share * cut).max() <= 2


def test_blend_is_a_pure_function_of_the_sample_index():
    a = blend(np.arange(100, 200), [0.6, 0.4])
    whole = blend(np.arange(0, 300), [0.6, 0.4])
    assert (a[0] == whole[0][100:200]).all() and (a[1] == whole[1][100:200]).all()


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="positive"):
        blend(np.arange(3), [1.0, 0.0])
