"""A worker group without Ray, so that the driver's loop, recovery and resize run in-process.

``FakeCluster`` plays Ray's part: placement groups over a number of worker slots (capacity that
tests take away and give back), actors that start, die and answer, and a clock of step calls.
``FakeGroup`` is raytp's WorkerGroup with every call to the workers done in-process: its workers'
"model" is one float64 number x that each step s moves by a fixed amount, so a run that replays
steps after a failure ends at the very x of an uninterrupted run only if the runtime restored the
right state at the right step (the state: tests/fake_state.py; a streamed call: tests/fake_stream.py;
the driver's control channel and snapshot copy: tests/fake_driver_parts.py). The bookkeeping
(``with_workers``, ``started``, ``successor``, bundles, layout) is WorkerGroup's own.
"""
import torch
from ray.exceptions import RayActorError

from fake_state import NAME, Ref, _Id, state_of
from fake_stream import FakeStream
from raytp.config.adapters import model_args
from raytp.moves.planner import SourceKind
from raytp.runtime.errors import PlacementError
from raytp.runtime.cluster.group import WorkerGroup
from raytp.runtime.leaving import WaitedOut

class FakePG:
    def __init__(self, cluster, n: int):
        self.cluster, self.id, self.bundle_count, self.placed, self.removed = cluster, _Id(), n, False, False


class FakeActor:
    def __init__(self, cluster, pg: FakePG, rank: int):
        self._actor_id = _Id()
        self.cluster, self.pg, self.rank = cluster, pg, rank
        self.alive, self.x, self.completed = True, 0.0, 0
        self.kept = {}  # step -> its record, as Worker.kept_records reads them
        # The newest call begun here, and the step it ended at if it ended well and the process groups
        # stayed since: what a call submitted behind it needs to start (raytp.runtime.worker.calls).
        self.newest, self.ended_at = None, None
        self.born, self.started = cluster.clock, False

    @property
    def up(self) -> bool:
        """Placed (its group is) and started (its process takes `start_calls` step calls to come up,
        unless a join waited for it)."""
        return self.alive and self.pg.placed and (
            self.started or self.cluster.clock >= self.born + self.cluster.start_calls)


class FakeCluster:
    """Ray's part: `slots` worker slots, placement groups on them, faults scheduled by step."""

    def __init__(self, slots: int, start_calls: int = 0):
        self.slots, self.start_calls = slots, start_calls
        self.pgs: list[FakePG] = []
        self.clock = 0                       # step calls made so far
        self.deaths: dict[int, tuple[list[int], int]] = {}  # step -> (ranks that die in it, slots lost with them)
        self.returns: dict[int, int] = {}     # step -> slots that come back before it
        self.failing_steps: set[int] = set()  # steps that raise on every rank (a bug of the job)
        self.snapshot_s: float | None = None  # what a snapshot costs, as workers report it with each step
        self.during: dict[int, object] = {}   # step -> a function called while that step runs (a request filed)
        self.calls: list[tuple] = []          # (start, count, submitted behind another call) of each call run
        self.released = []
        self.asked: list[list] = []  # what the autoscaler was asked for, in order ([]: withdrawn)
        self.blocked: set[int] = set()  # survivors the next recovery finds blocked for good in the failed step

    # -- what tests do to it
    def kill_at(self, step: int, *ranks: int, slots: int = 0) -> None:
        """Ranks die in step `step`; with `slots`, their node goes too (that capacity leaves)."""
        self.deaths[step] = (list(ranks), slots)

    def give_at(self, step: int, slots: int) -> None:
        """Capacity comes back before step `step` runs."""
        self.returns[step] = slots

    def take(self, n: int) -> None:
        """Capacity leaves (a node goes): the newest placed groups it held lose their placement."""
        self.slots -= n
        for pg in reversed(self.pgs):
            if self.free() >= 0:
                break
            pg.placed = False

    def give(self, n: int) -> None:
        self.slots += n
        self.placed(self.pgs)

    def group_class(self):
        return type("BoundFakeGroup", (FakeGroup,), {"placer": self})

    # -- the placement functions WorkerGroup.placer provides
    def free(self) -> int:
        return self.slots - sum(pg.bundle_count for pg in self.pgs if pg.placed)

    def request_replicas(self, cfg, run, tp, dp_ranks, avoid_nodes=frozenset()):
        out = {q: FakePG(self, tp) for q in dp_ranks}
        self.pgs += out.values()
        self.placed(out.values())
        return out

    def reserve_replicas(self, cfg, run, tp, dp_ranks, timeout_s, avoid_nodes=frozenset()):
        out = self.request_replicas(cfg, run, tp, dp_ranks)
        if not all(pg.placed for pg in out.values()):
            self.release(out.values())
            raise PlacementError(f"could not place the workers: {len(dp_ranks)} x {tp} slots, {self.free()} free")
        return out

    def reserve_tp(self, cfg, run, pgs, old_dp):
        """Fresh groups for every replica (the fake has no extensions): (placement, requested, unused)."""
        new = self.reserve_replicas(cfg, run, cfg.parallel.tp, list(range(cfg.parallel.dp)), 0)
        return new, list(new.values()), list(pgs.values())

    def check_room(self, cfg, bundles, what):
        if sum(bundles) > self.free():
            raise PlacementError(f"no room for {what} beside the job: {sum(bundles)} slots, {self.free()} free")

    @staticmethod
    def free_by_node():
        return None  # one node: no stage is ever moved off its twin's

    @staticmethod
    def size_of(pg) -> int:
        return pg.bundle_count

    @staticmethod
    def draining() -> dict:
        return {}  # Ray drains no node of a fake cluster

    def ask_capacity(self, bundles) -> None:
        self.asked.append(list(bundles))

    def withdraw_capacity(self) -> None:
        self.asked.append([])

    def placed(self, pgs) -> bool:
        for pg in pgs:
            if not pg.placed and not pg.removed and self.free() >= pg.bundle_count:
                pg.placed = True
        return all(pg.placed for pg in pgs)

    def release(self, pgs) -> None:
        for pg in list(pgs):
            if not pg.removed:
                pg.removed, pg.placed = True, False
                self.released.append(pg)
                self.pgs.remove(pg)

    def nodes_of(self, pgs) -> set:
        return {"node"}

    @staticmethod
    def groups_of(replica) -> list:
        return [replica]

    @staticmethod
    def alive_nodes() -> list:
        return ["node"]


class FakeLauncher:
    def __init__(self, run, worker_cls, evict=None, say=None):
        self.run = run

    def prepare_nodes(self, cfg, pgs):
        pass

    def start(self, cfg, pgs, rank, timeout_s=30.0, ahead=0, name=None, live=frozenset):
        dp_rank, tp_rank = divmod(rank, cfg.parallel.tp)
        pg = pgs[dp_rank]
        return FakeActor(pg.cluster, pg, rank), (pg.id.hex(), tp_rank)


class FakeGroup(WorkerGroup):
    launcher_cls = FakeLauncher
    placer: FakeCluster  # set by FakeCluster.group_class

    # -- joining
    def join(self, setup=(), reshape=(), state=None, states=None, started=()):
        from raytp.runtime.worker.planned_source import PlannedSource
        setup, reshape = set(setup), set(reshape)
        for r, w in enumerate(self.workers):
            if not (w.alive and w.pg.placed):
                raise RayActorError()
            w.started = True  # a join waits for the process to come up
            src = states.get(r, state) if states is not None else state
            if isinstance(src, PlannedSource):  # the fake state is replicated: any block is all of it
                w.x = src.refs[0].value if src.refs else w.x  # (none sent: a kept process keeps its own)
            elif r in setup or r in reshape:
                w.x = src.value["model"][NAME].item() if isinstance(src, Ref) else \
                    src["model"][NAME].item() if src is not None else 0.0
            w.rank, w.ended_at = r, None  # its process groups are new
        where = tuple({"rank": r, "node_id": "node", "pid": w._actor_id.n} for r, w in enumerate(self.workers))
        return self._with(placement=where)

    def assume(self, ranks):
        pass  # a fake process runs any job

    def leave(self):
        for w in self.workers:
            w.ended_at = None

    def first_where(self):
        return {"rank": 0, "device_bytes": None}  # fake GPUs: no memory to compare

    # -- training
    def run_steps(self, start, count, snapshot_every):
        return FakeStream(self, start, count, snapshot_every)

    def evaluate(self, step):
        return 1.0 / (1.0 + self.workers[0].x)

    def logits(self, idx):
        return torch.tensor([self.workers[0].x])

    # -- health
    def find_lost(self, suspects=()):
        return {r: "died" for r, w in enumerate(self.workers) if not w.alive}

    def wait_out(self, survivors):
        stuck = sorted(set(survivors) & self.placer.blocked)  # ended as blocked for good (leaving.wait_out)
        self.placer.blocked.clear()
        self.kill(stuck)
        for r in survivors:
            self.workers[r].ended_at = None  # they leave their process groups
        return WaitedOut({r: self.workers[r].completed for r in survivors if r not in stuck}, stuck, {}, {},
                         ended=tuple(stuck))

    def kept_records(self, completed, start):
        out = {}
        for r in sorted(completed, key=lambda r: (-completed[r], r)):
            for s in range(start, completed[r]):
                if s in self.workers[r].kept:
                    out.setdefault(s, (r, self.workers[r].kept[s]))
        return dict(sorted(out.items()))

    @staticmethod
    def pinged(actors):
        actors = list(actors)
        return [Ref(a) for a in actors]

    @staticmethod
    def answered(refs, timeout_s=0.0):
        return all(r.value.up if isinstance(r.value, FakeActor) else r.done() for r in refs)

    def check_up(self, actors):
        if not all(a.alive for a in actors):
            raise RayActorError()

    def up(self, ranks, timeout_s):
        return {r for r in ranks if self.workers[r].up}

    # -- state (the fake group is its own StateCalls)
    def state_calls(self):
        return self

    def commit_reshape(self, ranks):
        pass

    def revert(self, ranks):
        pass

    def fetch(self, refs):
        return [r.value for r in refs]

    def begin_save(self, url, directory):
        """Each rank of replica 0 writes its file (the fake state: one replicated tensor) at once."""
        from raytp.files import checkpoint
        from raytp.files.storage import Storage
        ranks = range(self.layout.tp)
        tensors = [checkpoint.state_tensors(state_of(self.workers[r].x)) for r in ranks]
        results = [Ref(checkpoint.write_shard(Storage(url), directory, tensors[r], r)) for r in ranks]
        return checkpoint.tensor_table(tensors[0], self.layout.tp, self.cfg.model.vocab_size), results

    def probe_storage(self, url, token):
        from raytp.files.storage import Storage, answer_probe
        return [answer_probe(Storage(url), token, r) for r in range(len(self.workers))]

    def load_source(self, source, step):
        from raytp.files.checkpoint import open_checkpoint
        from raytp.files.storage import Storage
        x = open_checkpoint(Storage(source.url), source.directory, source.manifest).read(f"model/{NAME}", 0, 1)
        for w in self.workers:
            w.x, w.completed = x.item(), step

    def write_snapshot(self, url, directory, parts, task):  # (the task's function, in this process)
        from raytp.runtime.state.checkpoints import write_part
        return [write_part(url, directory, ref.value, self.layout, t, model_args(self.cfg))
                for t, ref in enumerate(parts)]

    def export_moves(self, moves):
        """The state mover's plan (raytp.runtime.state.moving): each live source sends its x to the ranks whose
        moves read it."""
        sent = {}
        for m in moves:
            if m.source.kind is SourceKind.LIVE and not m.in_place:
                sent.setdefault(m.dst, {})[m.source.rank] = Ref(self.workers[m.source.rank].x)
        return {d: list(v.values()) for d, v in sent.items()}, 8 * len(sent)

    def take_moves(self, planned, step):
        """Each rank takes x from what its plan reads (a snapshot part, else a bundle; else it keeps its own)."""
        for r, src in planned.items():
            w = self.workers[r]
            if src.parts:
                w.x = src.parts[0][1].value["model"][NAME].item()
            elif src.refs:
                w.x = src.refs[0].value
            w.completed = step

    @staticmethod
    def kill_actors(actors):
        for a in actors:
            a.alive = False

    def release(self):
        self.kill_actors(self.workers)
        self.placer.release(self.pgs.values())
