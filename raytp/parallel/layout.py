"""Layout(tp, pp=, dp=, zero=): pure rank arithmetic of a TP x PP x DP mesh, no processes.

Rank order is TP fastest, then pipeline stage, then replica:
``rank = (dp * pp_degree + pp) * tp_degree + tp``. So the ranks of one TP
group (one stage of one replica) are contiguous and map onto consecutive
bundles of one placement group, i.e. onto one node, where their several
collectives per layer find fast links; a replica's stages follow each other
(one placement group each, on nodes of their own), and the DP group of a
shard strides across replicas (and so across nodes).

A rank's place is ``coords(rank)``, a ``Coords`` with named fields (``.tp``,
``.pp``, ``.dp``): never indexed by position, so adding a dimension cannot
silently change what a call site reads. The degrees after ``tp`` are keyword
arguments for the same reason.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass


@dataclass(frozen=True)
class Coords:
    """Where a rank sits: its TP rank, pipeline stage and DP replica."""
    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class Layout:
    tp: int
    _: KW_ONLY
    pp: int = 1
    dp: int = 1
    zero: int = 0  # 1: AdamW state sharded over DP (raytp.train.optimizer): who owns what changes

    def __post_init__(self):
        for key in ("tp", "pp", "dp"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Layout.{key} must be a positive integer, got {v!r}")
        if self.zero not in (0, 1):
            raise ValueError(f"Layout.zero must be 0 or 1, got {self.zero!r}")

    @property
    def sharded_optimizer(self) -> bool:
        """Whether each DP rank keeps its own part of the AdamW state (zero 1 with more than one replica)."""
        return self.zero == 1 and self.dp > 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def replica_size(self) -> int:
        """Ranks of one model replica (all its stages)."""
        return self.tp * self.pp

    def rank(self, *, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        if not (0 <= tp < self.tp and 0 <= pp < self.pp and 0 <= dp < self.dp):
            raise ValueError(f"(tp={tp}, pp={pp}, dp={dp}) outside {self}")
        return (dp * self.pp + pp) * self.tp + tp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size} ({self})")
        rest, tp = divmod(rank, self.tp)
        dp, pp = divmod(rest, self.pp)
        return Coords(tp=tp, pp=pp, dp=dp)

    def tp_group(self, dp: int, pp: int = 0) -> list[int]:
        """Ranks that hold the TP shards of one stage of one replica (contiguous: one node)."""
        return [self.rank(tp=t, pp=pp, dp=dp) for t in range(self.tp)]

    def pp_group(self, tp: int, dp: int) -> list[int]:
        """Ranks that hold the stages of one replica at one TP rank, first stage first."""
        return [self.rank(tp=tp, pp=s, dp=dp) for s in range(self.pp)]

    def dp_group(self, tp: int, pp: int = 0) -> list[int]:
        """Ranks that hold the same shard in different replicas."""
        return [self.rank(tp=tp, pp=pp, dp=d) for d in range(self.dp)]

    def replica(self, dp: int) -> list[int]:
        """Every rank of replica `dp` (all its stages): contiguous."""
        start = dp * self.replica_size
        if not 0 <= dp < self.dp:
            raise ValueError(f"replica {dp} outside {self}")
        return list(range(start, start + self.replica_size))

    def tp_groups(self) -> list[list[int]]:
        return [self.tp_group(d, s) for d in range(self.dp) for s in range(self.pp)]

    def pp_groups(self) -> list[list[int]]:
        return [self.pp_group(t, d) for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        return [self.dp_group(t, s) for s in range(self.pp) for t in range(self.tp)]

    def embedding_group(self, tp: int, dp: int) -> list[int]:
        """The first and the last stage at one TP rank of one replica: the two copies of a tied embedding
        (raytp.models.stage), whose gradients are summed over this group; one rank at pp == 1."""
        return sorted({self.rank(tp=tp, pp=0, dp=dp), self.rank(tp=tp, pp=self.pp - 1, dp=dp)})

    def embedding_groups(self) -> list[list[int]]:
        return [self.embedding_group(t, d) for d in range(self.dp) for t in range(self.tp)]

    def __str__(self) -> str:
        return (f"TP={self.tp} x " + (f"PP={self.pp} x " if self.pp > 1 else "") + f"DP={self.dp}"
                + (" (ZeRO-1)" if self.sharded_optimizer else ""))
