"""Layout(tp, dp): pure rank arithmetic of a DP x TP mesh, no processes.

Ranks of one TP group are contiguous (rank = dp_rank * tp + tp_rank), so a
TP group maps onto consecutive bundles of a placement group, i.e. onto one
node, where its several all-reduces per layer find fast links; the DP group
of a shard strides across the TP groups (and so across nodes).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int = 1

    def __post_init__(self):
        for key in ("tp", "dp"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Layout.{key} must be a positive integer, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def rank(self, dp_rank: int, tp_rank: int) -> int:
        if not (0 <= dp_rank < self.dp and 0 <= tp_rank < self.tp):
            raise ValueError(f"(dp_rank={dp_rank}, tp_rank={tp_rank}) outside {self}")
        return dp_rank * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """rank -> (dp_rank, tp_rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size} ({self})")
        return divmod(rank, self.tp)

    def tp_group(self, dp_rank: int) -> list[int]:
        """Ranks that hold the shards of one model replica."""
        return [self.rank(dp_rank, t) for t in range(self.tp)]

    def dp_group(self, tp_rank: int) -> list[int]:
        """Ranks that hold the same shard in different replicas."""
        return [self.rank(d, tp_rank) for d in range(self.dp)]

    def tp_groups(self) -> list[list[int]]:
        return [self.tp_group(d) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [self.dp_group(t) for t in range(self.tp)]

    def __str__(self) -> str:
        return f"TP={self.tp} x DP={self.dp}"
