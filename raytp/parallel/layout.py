"""Layout: the one mesh of a job, every dimension named; pure rank arithmetic, no processes.

The dense mesh is TP x CP x PP x DP (Megatron's order, TP innermost). Rank
order is TP fastest, then context-parallel rank, then pipeline stage, then
replica: ``rank = ((dp * pp_degree + pp) * cp_degree + cp) * tp_degree + tp``.
So the ranks of one TP group are contiguous and map onto consecutive bundles of
one placement group, i.e. onto one node, where their several collectives per
layer find fast links, and the CP ranks of a stage (each a part of every
sequence, the same weights) follow them; a replica's stages follow each other
(one placement group each, on nodes of their own), and the DP group of a shard
strides across replicas (and so across nodes). At cp 1 the ranks are those of
the TP x PP x DP mesh.

Expert layers see the same ranks through a second mesh, folded over DP x CP x TP
inside each stage as Megatron's "parallel folding" and torchtitan's
``dp_shard_in_ep`` do: ETP x EP x expert-DP, ETP fastest. A rank's place in a
stage is ``i = (dp * cp_degree + cp) * tp_degree + tp``, and
``i = (edp * ep_degree + ep) * etp_degree + etp``; ``edp_degree = dp * cp * tp / (ep * etp)``. With
``etp == tp`` the expert TP group is
the TP group and EP strides over replicas; with ``etp == 1`` EP runs over TP first.

Every axis has a name (``AXES``); ``coord(rank, axis)`` reads one, ``group(rank,
axes)`` is the sub-mesh through a rank along some axes, ``groups(axes)`` all of
them in one fixed order (every process builds process groups in it). A rank's
dense place is ``coords(rank)``, a ``Coords`` with named fields: never indexed by
position, so adding a dimension cannot silently change what a call site reads.
The degrees after ``tp`` are keyword arguments for the same reason.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import KW_ONLY, dataclass
from typing import Iterable

DENSE_AXES = ("tp", "cp", "pp", "dp")  # fastest first
SCALED = ("tp", "cp", "pp", "dp", "ep")  # the degrees a job sets and `raytp scale` changes
EXPERT_AXES = ("etp", "ep", "edp")   # inside a stage, fastest first, folded over dp x tp
AXES = DENSE_AXES + EXPERT_AXES


@dataclass(frozen=True)
class Coords:
    """Where a rank sits on the dense mesh: its TP rank, pipeline stage, DP replica and context-parallel rank."""
    tp: int
    pp: int
    dp: int
    cp: int = 0


@dataclass(frozen=True)
class Layout:
    tp: int
    _: KW_ONLY
    pp: int = 1
    dp: int = 1
    zero: int = 0  # 1: AdamW state sharded over DP (raytp.train.optimizer): who owns what changes
    ep: int = 1    # expert parallel degree (folded over dp x tp)
    etp: int | None = None  # tensor parallel degree inside an expert: 1 or tp (None: tp, whatever tp becomes)
    cp: int = 1    # context parallel degree: each rank a part of every sequence, the weights replicated over it

    def __post_init__(self):
        for key in ("tp", "pp", "dp", "ep", "etp", "cp"):
            v = getattr(self, key) if key != "etp" else self.expert_tp
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Layout.{key} must be a positive integer, got {v!r}")
        if self.zero not in (0, 1):
            raise ValueError(f"Layout.zero must be 0 or 1, got {self.zero!r}")
        if self.expert_tp not in (1, self.tp):
            raise ValueError(f"Layout.etp must be 1 or tp ({self.tp}), got {self.etp}")
        if self.stage_size % (self.ep * self.expert_tp):
            over = f"dp x tp ({self.dp} x {self.tp})" if self.cp == 1 else \
                f"dp x cp x tp ({self.dp} x {self.cp} x {self.tp})"
            raise ValueError(f"Layout.ep x etp ({self.ep} x {self.expert_tp}) must divide {over}: experts are folded "
                             "over the ranks of a stage")

    @classmethod
    def of(cls, parallel) -> "Layout":
        """The layout a job's ``parallel`` section asks for (raytp.config.schema.Parallel)."""
        return cls(parallel.tp, pp=parallel.pp, dp=parallel.dp, zero=parallel.zero,
                   ep=getattr(parallel, "ep", 1), etp=getattr(parallel, "etp", None), cp=getattr(parallel, "cp", 1))

    def degrees(self) -> dict[str, int]:
        """Every degree a job sets and a scale request changes (``SCALED``), by name."""
        return {a: getattr(self, a) for a in SCALED}

    def changed(self, **degrees: int | None) -> "Layout":
        """This layout with the named degrees changed (a None leaves one as it is); validated as any."""
        return dataclasses.replace(self, **{k: v for k, v in degrees.items() if v is not None})

    @property
    def sharded_optimizer(self) -> bool:
        """Whether each DP (x CP) rank keeps its own part of the AdamW state (zero 1 with more than one rank to cut
        it over: ``grad_degree``)."""
        return self.zero == 1 and self.grad_degree > 1

    @property
    def grad_degree(self) -> int:
        """How many ranks sum each dense gradient, the ranks the distributed optimizer cuts its rows over: DP x CP
        (CP ranks hold the same weights and each computes with its part of every sequence)."""
        return self.dp * self.cp

    def grad_place(self, rank: int) -> int:
        """`rank`'s place among the ``grad_degree`` ranks summing its gradients (its group along dp and cp)."""
        c = self.coords(rank)
        return c.dp * self.cp + c.cp

    @property
    def sharded_experts(self) -> bool:
        """Whether each expert-DP rank keeps its own part of its experts' AdamW state (the distributed optimizer,
        with experts on a mesh of their own and an expert-DP group of more than one rank)."""
        return self.sharded_optimizer and self.experts_split and self.degree("edp") > 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def replica_size(self) -> int:
        """Ranks of one model replica (all its stages, each with its CP ranks)."""
        return self.tp * self.cp * self.pp

    @property
    def stage_ranks(self) -> int:
        """Ranks of one stage of one replica (TP x CP): one placement group's bundles, on one node."""
        return self.tp * self.cp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage over all replicas (what the expert mesh folds over)."""
        return self.dp * self.cp * self.tp

    @property
    def expert_tp(self) -> int:
        """The TP degree inside an expert: etp, or tp where etp is not given."""
        return self.tp if self.etp is None else self.etp

    @property
    def experts_split(self) -> bool:
        """Whether expert layers have an expert mesh of their own: experts over EP, or whole on each TP rank."""
        return self.ep > 1 or self.expert_tp != self.tp

    def degree(self, axis: str) -> int:
        """How many ranks lie along `axis` (expert-DP: what EP x ETP leave of dp x tp)."""
        if axis == "edp":
            return self.stage_size // (self.ep * self.expert_tp)
        if axis == "etp":
            return self.expert_tp
        if axis not in AXES:
            raise ValueError(f"no mesh axis {axis!r}; axes: {', '.join(AXES)}")
        return getattr(self, axis)

    # -- rank <-> coordinates ------------------------------------------------------------------
    def rank(self, *, tp: int = 0, pp: int = 0, dp: int = 0, cp: int = 0) -> int:
        if not (0 <= tp < self.tp and 0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= cp < self.cp):
            raise ValueError(f"(tp={tp}, cp={cp}, pp={pp}, dp={dp}) outside {self}")
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size} ({self})")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        dp, pp = divmod(rest, self.pp)
        return Coords(tp=tp, pp=pp, dp=dp, cp=cp)

    def coord(self, rank: int, axis: str) -> int:
        """`rank`'s coordinate along one named axis, dense or expert."""
        c = self.coords(rank)
        if axis in DENSE_AXES:
            return getattr(c, axis)
        rest, etp = divmod((c.dp * self.cp + c.cp) * self.tp + c.tp, self.expert_tp)  # its place in its stage
        edp, ep = divmod(rest, self.ep)
        return {"etp": etp, "ep": ep, "edp": edp}[self._axis(axis)]

    def rank_at(self, **at: int) -> int:
        """The rank at named coordinates of one mesh: dense (tp, cp, pp, dp) or expert (etp, ep, edp, and pp);
        an axis left out is 0."""
        if set(at) <= set(DENSE_AXES):
            return self.rank(**at)
        if not set(at) <= set(EXPERT_AXES) | {"pp"}:
            raise ValueError(f"coordinates {sorted(at)} mix the dense and expert meshes")
        for axis, v in at.items():
            if not 0 <= v < self.degree(axis):
                raise ValueError(f"{axis}={v} outside {self} (degree {self.degree(axis)})")
        i = (at.get("edp", 0) * self.ep + at.get("ep", 0)) * self.expert_tp + at.get("etp", 0)
        rest, tp = divmod(i, self.tp)
        dp, cp = divmod(rest, self.cp)
        return self.rank(tp=tp, cp=cp, pp=at.get("pp", 0), dp=dp)

    def bundle_index(self, rank: int) -> int:
        """Which bundle of its replica's placement a rank takes: stage by stage, in each CP rank by CP rank, TP
        rank in each."""
        c = self.coords(rank)
        return (c.pp * self.cp + c.cp) * self.tp + c.tp

    # -- sub-meshes ----------------------------------------------------------------------------
    def group(self, rank: int, axes: str | Iterable[str]) -> list[int]:
        """The ranks that differ from `rank` only along `axes` (one mesh's axes, by name), ascending."""
        axes = self._axes(axes)
        mesh = DENSE_AXES if set(axes) <= set(DENSE_AXES) else EXPERT_AXES + ("pp",)
        at = {a: self.coord(rank, a) for a in mesh}
        out = []
        for values in itertools.product(*(range(self.degree(a)) for a in axes)):
            at.update(zip(axes, values))
            out.append(self.rank_at(**at))
        return sorted(out)

    def groups(self, axes: str | Iterable[str]) -> list[list[int]]:
        """Every sub-mesh along `axes`, ordered by its first rank: the order every process creates them in."""
        out, seen = [], set()
        for r in range(self.world_size):
            if r not in seen:
                g = self.group(r, axes)
                seen.update(g)
                out.append(g)
        return out

    def _axes(self, axes: str | Iterable[str]) -> tuple[str, ...]:
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        names = tuple(self._axis(a) for a in names)
        if not (set(names) <= set(DENSE_AXES) or set(names) <= set(EXPERT_AXES) | {"pp"}):
            raise ValueError(f"axes {names} mix the dense and expert meshes")
        return names

    @staticmethod
    def _axis(axis: str) -> str:
        if axis not in AXES:
            raise ValueError(f"no mesh axis {axis!r}; axes: {', '.join(AXES)}")
        return axis

    # -- the dense sub-meshes by their usual names ---------------------------------------------
    def stage_group(self, dp: int, pp: int = 0) -> list[int]:
        """Ranks of one stage of one replica (its ``stage_ranks``: one placement group, on one node)."""
        return self.group(self.rank(pp=pp, dp=dp), ("tp", "cp"))

    def tp_group(self, dp: int, pp: int = 0, cp: int = 0) -> list[int]:
        """Ranks that hold the TP shards of one stage of one replica (contiguous: one node)."""
        return self.group(self.rank(pp=pp, dp=dp, cp=cp), "tp")

    def pp_group(self, tp: int, dp: int, cp: int = 0) -> list[int]:
        """Ranks that hold the stages of one replica at one TP rank, first stage first."""
        return self.group(self.rank(tp=tp, dp=dp, cp=cp), "pp")

    def dp_group(self, tp: int, pp: int = 0, cp: int = 0) -> list[int]:
        """Ranks that hold the same shard in different replicas."""
        return self.group(self.rank(tp=tp, pp=pp, cp=cp), "dp")

    def replica(self, dp: int) -> list[int]:
        """Every rank of replica `dp` (all its stages): contiguous."""
        if not 0 <= dp < self.dp:
            raise ValueError(f"replica {dp} outside {self}")
        start = dp * self.replica_size
        return list(range(start, start + self.replica_size))

    def tp_groups(self) -> list[list[int]]:
        return self.groups("tp")

    def pp_groups(self) -> list[list[int]]:
        return self.groups("pp")

    def dp_groups(self) -> list[list[int]]:
        return self.groups("dp")

    def embedding_group(self, tp: int, dp: int, cp: int = 0) -> list[int]:
        """The first and the last stage at one TP (and CP) rank of one replica: the two copies of a tied embedding
        (raytp.models.stage), whose gradients are summed over this group; one rank at pp == 1."""
        return sorted({self.rank(tp=tp, pp=0, dp=dp, cp=cp), self.rank(tp=tp, pp=self.pp - 1, dp=dp, cp=cp)})

    def embedding_groups(self) -> list[list[int]]:
        return [self.embedding_group(t, d, c) for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def __str__(self) -> str:
        experts = (f" x EP={self.ep}" if self.ep > 1 else "") + (
            f" (ETP={self.expert_tp})" if self.experts_split and self.tp > 1 else "")
        return (f"TP={self.tp} x " + (f"CP={self.cp} x " if self.cp > 1 else "") + (
            f"PP={self.pp} x " if self.pp > 1 else "") + f"DP={self.dp}" + experts
                + (" (ZeRO-1)" if self.sharded_optimizer else ""))
