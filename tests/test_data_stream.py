"""Token streams over pieces of files, and the validation documents held out of them (raytp.data.stream)."""
from __future__ import annotations

import numpy as np
import pytest

from raytp.data.stream import Stream, held_per_file, hold_out, tail


def test_a_read_across_pieces_is_the_concatenation():
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 1000, n).astype(np.uint16) for n in (5, 1, 0, 17, 3)]
    whole = np.concatenate(pieces).astype(np.int64)
    s = Stream(pieces)
    assert len(s) == len(whole)
    for start in range(len(whole)):
        for length in (0, 1, 4, len(whole) - start):
            if start + length <= len(whole):
                assert (s.read(start, length) == whole[start:start + length]).all()
    with pytest.raises(IndexError):
        s.read(len(whole) - 2, 3)
    starts = np.arange(len(whole) - 4)
    assert (s.rows(starts, 4) == np.stack([whole[a:a + 4] for a in starts])).all()  # in pieces and across


@pytest.mark.parametrize("n_docs,fraction", [(2, 0.5), (10, 0.1), (100, 0.1), (1000, 0.05), (37, 0.5)])
def test_whole_documents_are_held_out_spread_over_the_file(n_docs, fraction):
    rng = np.random.default_rng(n_docs)
    ends = np.cumsum(rng.integers(1, 50, n_docs))
    starts = np.concatenate([[0], ends[:-1]])
    (held,) = held_per_file([n_docs], fraction)
    assert held == round(n_docs * fraction) or held == n_docs - 1
    train, val = hold_out(ends, held)
    covered = sorted(train + val)
    assert covered[0][0] == 0 and covered[-1][1] == ends[-1]
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # disjoint, and nothing left out
    edges = set(starts.tolist()) | {int(ends[-1])}
    assert all(a in edges and b in edges for a, b in train + val)  # cut at document boundaries only
    assert sum(int(((starts >= a) & (ends <= b)).sum()) for a, b in val) == held
    assert train  # something to train on
    if held >= 16:  # spread: validation documents from all over the file, not its tail
        assert len(val) == 16 and val[0][0] < ends[-1] / 8


def test_a_source_of_many_small_files_holds_out_its_fraction_not_a_document_of_each():
    held = held_per_file([2] * 1000, 0.01)  # 1000 shards of two long documents each, 1%
    assert sum(held) == 20 and max(held) == 1  # 20 documents (1%), from 20 shards, not 1000 (50%)
    assert np.flatnonzero(held).max() > 900  # spread over the source, not its first shards
    assert held_per_file([3], 0.001) is None  # no whole document: the tail of its tokens instead
    assert held_per_file([1] * 50, 0.1) is None  # single-document files keep theirs for training
    assert tail(1000, 0.1) == 900 and tail(5, 0.01) == 4


def test_nothing_held_out_of_a_file_its_source_spares():
    assert hold_out(np.array([10, 20, 30]), 0) == ([(0, 30)], [])


def test_a_dataset_of_more_shards_than_open_files_raises_the_limit_or_says_what_to_do():
    import subprocess
    import sys
    script = """
import resource, sys
from raytp.data.token_sources import _open_files_for
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
_open_files_for(1000, "ds")
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))
try:
    _open_files_for(1000, "ds")
except ValueError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert int(lines[0]) == 2024, out.stderr
    assert lines[1] == "ds: 1,000 shards to map, but a process here may open 512 files (ulimit -Hn); raise it, " \
                       "or prepare the corpus again with a larger --shard-tokens"
