"""Point-to-point between pipeline stages: stage s's TP rank t talks to stage s±1's TP rank t only.

What crosses between nodes is cut by TP, as Megatron's ``scatter_gather_tensors_in_pipeline``
does: under sequence parallelism each TP rank already holds its 1/tp slice of
the sequence and sends just that; without it every TP rank holds the same
activation, so each sends a different 1/tp of it (flattened) and the
receiving stage all-gathers the pieces inside its node. Either way a
pipeline moves 2 x m x b x s x h x bytes x (p - 1) per step across nodes,
not tp times that (``sent_bytes`` counts it).

Sends are posted (``isend``) as soon as their tensor is made and waited for
at the end of the step (``finish``); a receive is posted right before the
compute that needs it and waited for then. A message carries a tag naming its
(micro-batch, chunk, direction), so on gloo a schedule that got the order
wrong fails instead of mixing tensors up; NCCL ignores tags and matches in
order, which raytp.parallel.pp_schedule's tables keep the same on both sides.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from raytp.parallel.groups import ProcessGroups


class StageLink:
    """The point-to-point traffic of one rank's stage in one step."""

    def __init__(self, groups: ProcessGroups, sequence_parallel: bool):
        lay = groups.layout
        here = lay.coords(groups.rank)
        self.layout, self.here = lay, here
        self.tp_group, self.tp = groups.tp, lay.tp
        self.split = not sequence_parallel and lay.tp > 1  # send 1/tp, all-gather on arrival
        self.pending: list = []  # (work, tensor) of the sends in flight
        self.sent_bytes = 0

    def rank_of(self, stage: int) -> int:
        """The global rank of `stage` at this rank's TP rank and replica."""
        return self.layout.rank(tp=self.here.tp, pp=stage, dp=self.here.dp)

    def send(self, x: torch.Tensor, stage: int, tag: int) -> None:
        """Post the send of `x` (this rank's part of it) to `stage`; it completes by ``finish``."""
        part = self._part(x.detach()).contiguous()
        self.pending.append((dist.isend(part, self.rank_of(stage), tag=tag), part))
        self.sent_bytes += part.numel() * part.element_size()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device, stage: int, tag: int) -> torch.Tensor:
        """The tensor of `shape` that `stage` sends with `tag` (whole again if it came in parts)."""
        numel = 1
        for n in shape:
            numel *= n
        buf = torch.empty(numel // self.tp if self.split else numel, dtype=dtype, device=device)
        dist.irecv(buf, self.rank_of(stage), tag=tag).wait()
        if self.split:
            parts = [torch.empty_like(buf) for _ in range(self.tp)]
            dist.all_gather(parts, buf, group=self.tp_group)
            buf = torch.cat(parts)
        return buf.view(shape)

    def _part(self, x: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return x
        flat = x.reshape(-1)
        n = flat.numel() // self.tp
        return flat[self.here.tp * n:(self.here.tp + 1) * n]

    def finish(self) -> None:
        """Wait until every send of the step has been received."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def tag_of(kind: str, mb: int, chunk: int, chunks: int) -> int:
    """A message's tag: its micro-batch, model chunk and direction (activation forward, gradient back)."""
    return (mb * chunks + chunk) * 2 + (kind == "B")
