"""The reshard plan is exact: new shards assembled from pieces of old shards equal shards cut from the
whole tensor, for every split (rows, columns, q/k/v parts, a padded vocabulary) and TP degree pair."""
import pytest
import torch

from raytp.parallel.reshard_plan import Piece, moved_rows, pieces
from raytp.parallel.placements import REPLICATE, Shard
from raytp.parallel.sharding import local_shape, shard_tensor

CASES = [  # (split, full shape)
    (Shard(0), (12, 5)),
    (Shard(1), (5, 12)),
    (Shard(0, parts=3), (36, 4)),
    (Shard(0, pad=True), (37, 3)),  # vocabulary 37: padded at every tp > 1
    (Shard(0), (24,)),              # a bias
    (REPLICATE, (7, 3)),            # replicated
]


def assemble(s, full, old_tp, new_tp, dst):
    old = [shard_tensor(full, s, i, old_tp) for i in range(old_tp)]
    out = torch.zeros(local_shape(s, tuple(full.shape), new_tp))
    dim = s.dim or 0
    for p in pieces(s, full.shape[dim], old_tp, new_tp, dst):
        out.narrow(dim, p.dst_at, p.length).copy_(old[p.src].narrow(dim, p.src_at, p.length))
    return out


@pytest.mark.parametrize("s, shape", CASES)
def test_new_shards_from_pieces_equal_shards_of_the_whole(s, shape):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1
    for old_tp in (1, 2, 3, 4):
        for new_tp in (1, 2, 3, 4):
            if s.parts == 3 and (12 % old_tp or 12 % new_tp):
                continue  # q/k/v blocks of 12 rows: tp must divide them
            if not s.pad and s.dim is not None and s.parts == 1 and (shape[s.dim] % old_tp or shape[s.dim] % new_tp):
                continue
            for dst in range(new_tp):
                assert torch.equal(assemble(s, full, old_tp, new_tp, dst), shard_tensor(full, s, dst, new_tp)), \
                    (s, old_tp, new_tp, dst)


def test_pieces_of_a_vocabulary_split():
    s = Shard(0, pad=True)  # 37 rows: 38 at tp 2 (19 each), 40 at tp 4 (10 each, rank 3 holds 7 real)
    assert pieces(s, 37, 2, 4, 1) == [Piece(0, 10, 0, 9), Piece(1, 0, 9, 1)]
    assert pieces(s, 37, 4, 2, 1) == [Piece(1, 9, 0, 1), Piece(2, 0, 1, 10), Piece(3, 0, 11, 7)]  # row 18 of 19 pads
    assert pieces(REPLICATE, 7, 4, 2, 1) == [Piece(0, 0, 0, 7)]


def test_rows_that_change_owner():
    s = Shard(0)
    assert moved_rows(s, 8, 2, 4, kept=True) == 6    # new ranks 0, 1 keep 2 rows each of what they held
    assert moved_rows(s, 8, 2, 2, kept=True) == 0
    assert moved_rows(s, 8, 2, 2, kept=False) == 8
