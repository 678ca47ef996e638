"""AdamW state written by every DP rank under the distributed optimizer: blocks of rows, read at any layout.

Under ``parallel.zero`` 1 each DP rank keeps the AdamW moments of some rows of
each tensor (raytp.parallel.zero_plan), and writes them to its own file
(``tp000-dp001.safetensors``; DP rank 0's are in the weights' file): the
moment of a TP shard is cut along its rows (dim 0) into *blocks*, block d in
DP rank d's file, stored like the whole tensor would be (split dim first: a
row-parallel weight's block transposed). The manifest's entry for such a
tensor lists ``blocks: [[d, first row, end row], ...]`` (the same for every
TP rank of a stage, whose shards have one shape). A routed expert's moments under
the distributed optimizer are cut the same way over its expert-DP group
(raytp.files.checkpoint_experts): d is the DP rank of each member's file, and
where experts are whole on each TP rank (``tp: 1``) a fourth number names the
member's TP file.

A reader asks for TP rank r's slice at another TP degree as for any tensor
(raytp.parallel.reshard_plan's pieces along the split dim); from each block it
reads the piece's rows there: along dim 0 (column-parallel, replicated)
the piece and the block intersect in rows; for a row-parallel weight (split
along dim 1, stored transposed) each block holds those columns for its rows.
Either way every read is one contiguous byte range of one file.
"""
from __future__ import annotations

import torch

from raytp.parallel.zero_plan import BUCKET_NUMEL, plan

MOMENTS = ("exp_avg", "exp_avg_sq")


def blocks_of(shapes: list[tuple[int, ...]], dp: int, bucket_numel: int = BUCKET_NUMEL) -> list[list[list[int]]]:
    """Per tensor (in order): [[d, first row, end row], ...] of the DP ranks holding its rows."""
    out: list[list[list[int]]] = [[] for _ in shapes]
    for b in plan(shapes, dp, bucket_numel):
        for d, pieces in enumerate(b.ranges):
            for pc in pieces:
                out[pc.index].append([d, pc.start, pc.stop])
    for blocks in out:
        blocks.sort(key=lambda blk: blk[1])
    return out


def step_holder(blocks: list[list[int]]) -> int:
    """The DP rank whose file holds a tensor's AdamW step count: the holder of its first row."""
    return blocks[0][0]


def read_blocks(read_rows, spec: dict, src: int, src_at: int, length: int, out: torch.Tensor, dst_at: int,
                flip: bool) -> None:
    """Rows src_at .. src_at+length along the split dim of old TP rank `src`'s tensor, from its blocks
    (``spec["blocks"]``), into `out` at `dst_at` along the split dim. `read_rows(src, block, start, count)` reads
    rows of a block's stored tensor; `flip`: `out` is in the stored orientation (split dim first)."""
    dim = spec["dim"]
    for blk in spec["blocks"]:
        a, b = blk[1], blk[2]
        if dim == 1 and spec["transposed"]:  # every block holds these columns of its rows
            rows = read_rows(src, blk, src_at, length)          # (length, b - a)
            if flip:
                out.narrow(0, dst_at, length).narrow(1, a, b - a).copy_(rows)
            else:
                out.narrow(0, a, b - a).narrow(1, dst_at, length).copy_(rows.t())
            continue
        lo, hi = max(a, src_at), min(b, src_at + length)     # split along the rows (or not split)
        if hi > lo:
            out.narrow(0, dst_at + lo - src_at, hi - lo).copy_(read_rows(src, blk, lo - a, hi - lo))
