"""Point-to-point between pipeline stages: stage s's TP rank t talks to stage s±1's TP rank t only (of the same
CP rank: each holds the same chunks of the sequence).

What crosses between nodes is cut by TP, as Megatron's ``scatter_gather_tensors_in_pipeline``
does: under sequence parallelism each TP rank already holds its 1/tp slice of
the sequence and sends just that; without it every TP rank holds the same
activation, so each sends a different 1/tp of it (flattened) and the
receiving stage all-gathers the pieces inside its node. Either way a
pipeline moves 2 x m x b x s x h x bytes x (p - 1) per step across nodes,
not tp times that (``sent_bytes`` counts it).

Sends are posted (``isend``) as soon as their tensor is made and waited for
at the end of the step (``finish``). A stage knows up front every message it
will receive in the step, in order (``Expected``, from its row of the
schedule). On gloo a receive is posted one message ahead (Megatron's
``overlap_p2p_comm``): when the schedule takes message k, message k+1's
``irecv`` is already posted, so the sender's ``isend`` writes it straight
away and it lands while this stage computes. Gloo's sends wait for the
matching receive to be posted (a rendezvous through both sides' network
threads), so a receive posted only when it is needed costs that round trip
on busy cores every time. On NCCL the receive is posted when it is needed:
its operations with a peer run in order on one stream, so an early receive
would hold this rank's sends behind it (a deadlock), and a receive does not
block the host there anyway. A message carries a tag naming its
(micro-batch, chunk, direction), so on gloo a schedule that got the order
wrong fails instead of mixing tensors up; NCCL ignores tags and matches in
order, which raytp.parallel.pipeline.pp_schedule's tables keep the same on both sides.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raytp.parallel import comm
from raytp.parallel.groups import ProcessGroups


@dataclass(frozen=True)
class Expected:
    """A message this stage receives in the step: from `stage`, with `tag`, a tensor of `shape`."""
    stage: int
    tag: int
    shape: tuple[int, ...]


class StageLink:
    """The point-to-point traffic of one rank's stage in one step; `expected`: every message it receives
    in the step, in the order ``recv`` takes them (tensors of `dtype` on `device`)."""

    def __init__(self, groups: ProcessGroups, sequence_parallel: bool, expected: list[Expected],
                 dtype: torch.dtype, device: torch.device):
        lay = groups.layout
        here = lay.coords(groups.rank)
        self.layout, self.here = lay, here
        self.tp_group, self.tp = groups.tp, lay.tp
        self.split = not sequence_parallel and lay.tp > 1  # send 1/tp, all-gather on arrival
        self.dtype, self.device = dtype, device
        self.pending: list = []  # (work, tensor) of the sends in flight
        self.sent_bytes = 0
        self.expected = deque(expected)
        self.posted: deque = deque()  # (Expected, work, buffer) of the receives posted, oldest first
        self.ahead = 1 if comm.backend(None) == "gloo" else 0  # receives posted beyond the one being taken
        self._top_up(self.ahead)  # the step's first message: posted as the step starts

    def rank_of(self, stage: int) -> int:
        """The global rank of `stage` at this rank's TP rank, sequence chunk (context parallelism) and replica."""
        return self.layout.rank(tp=self.here.tp, pp=stage, dp=self.here.dp, cp=self.here.cp)

    def send(self, x: torch.Tensor, stage: int, tag: int) -> None:
        """Post the send of `x` (this rank's part of it) to `stage`; it completes by ``finish``."""
        part = self._part(x.detach()).contiguous()
        self.pending.append((dist.isend(part, self.rank_of(stage), tag=tag), part))
        self.sent_bytes += part.numel() * part.element_size()

    def recv(self, tag: int) -> torch.Tensor:
        """The next expected message, which must be `tag`'s (whole again if it came in parts). The
        ``ahead`` messages after it are posted before waiting for it: they land while this stage computes."""
        self._top_up(1 + self.ahead)
        if not self.posted or self.posted[0][0].tag != tag:
            wanted = self.posted[0][0].tag if self.posted else "none"
            raise RuntimeError(f"message {tag} received where the schedule expected message {wanted}")
        msg, work, buf = self.posted.popleft()
        work.wait()
        if self.split:
            parts = [torch.empty_like(buf) for _ in range(self.tp)]
            dist.all_gather(parts, buf, group=self.tp_group)
            buf = torch.cat(parts)
        return buf.view(msg.shape)

    def _top_up(self, n: int) -> None:
        """Post the next expected messages' receives until `n` are posted (or none are left)."""
        while len(self.posted) < n and self.expected:
            msg = self.expected.popleft()
            numel = math.prod(msg.shape)
            buf = torch.empty(numel // self.tp if self.split else numel, dtype=self.dtype, device=self.device)
            self.posted.append((msg, dist.irecv(buf, self.rank_of(msg.stage), tag=msg.tag), buf))

    def _part(self, x: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return x
        flat = x.reshape(-1)
        n = flat.numel() // self.tp
        return flat[self.here.tp * n:(self.here.tp + 1) * n]

    def finish(self) -> None:
        """Wait until every send of the step has been received (and every expected message taken)."""
        if self.posted or self.expected:
            raise RuntimeError(f"{len(self.posted) + len(self.expected)} expected messages were never taken")
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def tag_of(kind: str, mb: int, chunk: int, chunks: int) -> int:
    """A message's tag: its micro-batch, model chunk and direction (activation forward, gradient back)."""
    return (mb * chunks + chunk) * 2 + (kind == "B")
