"""A worker group's state in and out: its owners' shards read and written (checkpoints, snapshots, a source
loaded), and a state mover's plan exported by its live sources and taken in place (raytp.runtime.state.moving).

``StateCalls`` is a value of its own: the workers in rank order, their job (its layout) and how long a call
may take. raytp.runtime.cluster.group.WorkerGroup hands one out for each call (``WorkerGroup.state_calls``),
so the group's methods of the same names are where a test's fake group takes over."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import ray

from raytp.config.adapters import model_args
from raytp.moves.planner import SourceKind
from raytp.moves.owners import Owners


@dataclass(frozen=True)
class StateCalls:
    workers: tuple        # actor handles, rank order
    cfg: object           # the JobConfig at their layout

    @property
    def layout(self):
        return self.cfg.layout

    def owner_workers(self) -> list:
        """The workers that own the state (raytp.moves.owners), part 0 first."""
        return [self.workers[r] for r in Owners(self.layout).owners()]

    def fetch(self, refs, tasks: bool = False) -> list:
        """The (small) objects behind `refs`, in this process: what writers report, not tensors. `tasks`: the
        refs are tasks' that start processes of their own (a Python importing torch, slow on a loaded host),
        which may take runtime.placement_timeout_s to come up before their step_timeout_s of work."""
        rt = self.cfg.runtime
        return ray.get(list(refs), timeout=rt.step_timeout_s + (rt.placement_timeout_s if tasks else 0.0))

    def begin_save(self, url: str, directory: str) -> tuple[dict, list]:
        """Replica 0's ranks start writing their files of a checkpoint (raytp.runtime.state.checkpoints):
        (the tensor table, one ref per rank that resolves once its file is written)."""
        ranks = self.owner_workers()
        tables = ray.get([w.begin_save.remote(url, directory) for w in ranks], timeout=self.cfg.runtime.step_timeout_s)
        table = {k: v for t in tables if t for k, v in t.items()}  # each stage's TP rank 0 tells its tensors
        return table, [w.save_result.remote() for w in ranks]

    def probe_storage(self, url: str, token: str) -> list[str | None]:
        """Each worker reads the driver's probe file at `url` and writes its own (raytp.files.storage)."""
        return ray.get([w.probe_storage.remote(url, token) for w in self.workers],
                       timeout=self.cfg.runtime.step_timeout_s)

    def load_source(self, source, step: int) -> None:
        """Every worker takes its slices of `source` (raytp.files.state_sources) as the state after `step`."""
        ray.get([w.load.remote(source, step) for w in self.workers], timeout=self.cfg.runtime.step_timeout_s)

    def write_snapshot(self, url: str, directory: str, parts: list, task) -> list[dict]:
        """A snapshot's parts (refs, one per owner: stage by stage, TP rank in each) written as a checkpoint's
        files, by `task`s (raytp.runtime.state.checkpoints.write_part_task: the state room's, handed down),
        each as its owner's rank of this layout writes it."""
        lay, own = self.layout, Owners(self.layout)
        return self.fetch([task.remote(url, directory, ref, lay, own.owner(t), model_args(self.cfg))
                           for t, ref in enumerate(parts)], tasks=True)

    def export_moves(self, moves: list) -> tuple[dict, int]:
        """A plan's moves (raytp.moves.planner) exported by their live sources: ({destination: [refs of the
        bundles sent to it]}, bytes), the bundles kept in the object store, owned here and never fetched."""
        by_source: dict[int, list] = {}
        for m in moves:
            if m.source.kind is SourceKind.CHECKPOINT:
                raise ValueError(f"{m.key} of rank {m.dst} is planned from the checkpoint: a worker exports what "
                                 "it holds only (a checkpoint is restored whole)")
            if m.source.kind is SourceKind.LIVE and not m.in_place:
                by_source.setdefault(m.source.rank, []).append(m)
        sent: dict[int, list] = {}
        sizes = []
        for src, ms in sorted(by_source.items()):
            dsts = sorted({m.dst for m in ms})
            out = self.workers[src].export_moves.options(num_returns=len(dsts) + 1).remote(ms)
            for dst, ref in zip(dsts, out[:len(dsts)]):
                sent.setdefault(dst, []).append(ref)
            sizes.append(out[len(dsts)])
        return sent, sum(map(sum, self.fetch(sizes)))

    def take_moves(self, planned: Mapping[int, object], step: int) -> None:
        """Ranks fill the shards they hold by their plans ({rank: raytp.runtime.worker.planned_source
        .PlannedSource}), as the state after `step` (raytp.runtime.state.moving.take)."""
        ray.get([self.workers[r].take_moves.remote(src, step) for r, src in planned.items()],
                timeout=self.cfg.runtime.step_timeout_s)
