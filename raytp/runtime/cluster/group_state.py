"""A worker group's state in and out: its owners' shards read and written (checkpoints, snapshots, a source
loaded), copied from replicas, and under the distributed optimizer its AdamW rows cut for a new DP degree.

``StateCalls`` is a value of its own: the workers in rank order, their job (its layout) and how long a call
may take. raytp.runtime.cluster.group.WorkerGroup hands one out for each call (``WorkerGroup.state_calls``),
so the group's methods of the same names are where a test's fake group takes over."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import ray
from ray.exceptions import GetTimeoutError

from raytp.config.adapters import model_args
from raytp.moves.planner import SourceKind
from raytp.parallel.ownership import Ownership


@dataclass(frozen=True)
class StateCalls:
    workers: tuple        # actor handles, rank order
    cfg: object           # the JobConfig at their layout

    @property
    def layout(self):
        return self.cfg.layout

    def owner_workers(self) -> list:
        """The workers that own the state (raytp.parallel.ownership), part 0 first."""
        return [self.workers[r] for r in Ownership(self.layout).owners()]

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
        files, by `task`s (raytp.runtime.state.checkpoints.write_part_task: the state room's, handed down)."""
        cfg, lay = self.cfg, self.layout
        own = Ownership(lay)
        where = [lay.coords(own.owner(t)) for t in range(len(parts))]
        return self.fetch([task.remote(url, directory, c.tp, ref, lay.tp, model_args(cfg),
                                                  c.pp if lay.pp > 1 else None, lay.pp,
                                                  c.dp if lay.sharded_optimizer else 0, lay.dp, lay.sharded_optimizer,
                                                  (lay, own.owner(t)) if lay.experts_split else None)
                           for t, (c, ref) in enumerate(zip(where, parts))], tasks=True)

    def copy_shards(self, donors: Mapping[int, int], step: int, weights_only: bool = False) -> int:
        """Ranks take their shards from donors holding the same ones ({rank: donor rank}; `weights_only`:
        their weights), worker to worker through the object store; returns the bytes moved."""
        ws = self.workers
        self.hand_over({r: ws[d].get_state.remote(weights_only) for r, d in donors.items()}, step, weights_only)
        if weights_only:
            return sum(ray.get([ws[d].weights_nbytes.remote() for d in donors.values()]))
        return sum(ray.get([ws[d].state_nbytes.remote() for d in donors.values()]))

    def states_of(self, ranks: Iterable[int]) -> dict:
        """{rank: ref of its whole state}, put in the object store by each rank now and waited for (not fetched):
        ranks that are about to stop (a stage leaving a drained node) hand their own state over with it."""
        refs = {r: self.workers[r].get_state.remote() for r in ranks}
        _, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.cfg.runtime.step_timeout_s,
                           fetch_local=False)
        if late:
            raise GetTimeoutError(f"{len(late)} of ranks {sorted(refs)} did not hand over their state within "
                                  f"runtime.step_timeout_s={self.cfg.runtime.step_timeout_s:g}")
        return refs

    def hand_over(self, refs: Mapping[int, object], step: int, weights_only: bool = False) -> None:
        """Ranks take the states `refs` ({rank: ref}: a donor's ``get_state``, or ``states_of``) as theirs after
        `step` steps (`weights_only`: their weights)."""
        ray.get([self.workers[r].set_shard.remote(ref, step, weights_only) for r, ref in refs.items()],
                timeout=self.cfg.runtime.step_timeout_s)

    def export_moves(self, moves: list) -> tuple[dict, int]:
        """A plan's moves (raytp.moves.planner) exported by their live sources: ({destination: [refs of the
        bundles sent to it]}, bytes), the bundles kept in the object store, owned here and never fetched."""
        by_source: dict[int, list] = {}
        for m in moves:
            if m.source.kind is not SourceKind.LIVE:
                raise ValueError(f"{m.key} of rank {m.dst} is planned from a {m.source.kind.value}: a worker "
                                 "exports what it holds only")
            if not m.in_place:
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

    def export_rows(self, new_dp: int) -> tuple[list, list]:
        """A DP resize under zero 1: every rank cuts the AdamW rows it keeps into one bundle per DP rank of
        `new_dp` (raytp.runtime.worker.worker_state export_rows), kept in the object store, owned here and
        never fetched: (refs[rank][new DP rank], bytes[rank][new DP rank])."""
        return self._bundles("export_rows", new_dp)

    def _bundles(self, method: str, n: int) -> tuple[list, list]:
        """Every worker's `method`(n), called with n + 1 return objects (n bundles, then their sizes): the
        bundles' refs, kept in the object store and never fetched, and their sizes, fetched."""
        refs, sizes = [], []
        for w in self.workers:
            out = getattr(w, method).options(num_returns=n + 1).remote(n)
            refs.append(list(out[:n]))
            sizes.append(out[n])
        return refs, self.fetch(sizes)

    def recut_parts(self, refs: Mapping[int, list], old_dp: int, step: int) -> None:
        """Under zero 1, ranks take a snapshot's weights and their rows of its AdamW state at this layout's DP
        degree ({rank: the parts of old DP ranks 0.. at its TP rank and stage}, cut at `old_dp`) as the state
        after `step`."""
        ray.get([self.workers[r].recut_parts.remote(rs, old_dp, step) for r, rs in refs.items()],
                timeout=self.cfg.runtime.step_timeout_s)

    def take_rows(self, refs: Mapping[int, list]) -> None:
        """Ranks keep the AdamW rows of their DP position, filled from the bundles `refs` ({rank: [ref]})."""
        ray.get([self.workers[r].take_rows.remote(rs) for r, rs in refs.items()],
                timeout=self.cfg.runtime.step_timeout_s)

    def load_parts(self, ranks: Iterable[int], parts: Mapping[int, object], step: int) -> None:
        """Ranks take their part of a snapshot ({part: ref}, raytp.parallel.ownership) as the state after
        `step`."""
        own = Ownership(self.layout)
        ray.get([self.workers[r].set_shard.remote(parts[own.part(r)], step) for r in ranks],
                timeout=self.cfg.runtime.step_timeout_s)
