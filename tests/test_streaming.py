"""StepStream on real Ray: a call submitted behind another (``then``) starts on no rank before every rank
ended the one before, never starts once cancelled or after a rank was lost, and a step's records come
in rank order. The actors are small threaded stand-ins for raytp's Worker (the same streaming protocol,
steps that only sleep), so what is tested is the gating, not training."""
import sys
import threading
import time

import pytest
import ray

from raytp.parallel.layout import Layout
from raytp.runtime.cluster.streaming import StepStream

LAYOUT = Layout(2, dp=2)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class travels with its calls


class Ranks:
    """Serves run_steps for several ranks (threaded, as raytp's workers are); keeps (rank, start, event,
    time) of every call, and how many calls of a rank ran at once at most."""

    def __init__(self, step_s):
        self.step_s, self.log, self.running, self.overlap = step_s, [], {}, 0
        self.lock = threading.Lock()

    def run_steps(self, rank, start, count, snapshot_every=0):
        with self.lock:
            self.running[rank] = self.running.get(rank, 0) + 1
            self.overlap = max(self.overlap, self.running[rank])
            self.log.append((rank, start, "start", time.time()))
        try:
            for step in range(start, start + count):
                time.sleep(self.step_s * (1 + rank % 2))  # odd ranks end later
                yield {"step": step, "rank": rank}
        finally:
            with self.lock:
                self.running[rank] -= 1
                self.log.append((rank, start, "end", time.time()))

    def record(self):
        return self.log, self.overlap


class Rank:
    """One rank's handle onto a Ranks actor (its calls carry the rank)."""

    def __init__(self, actor, rank):
        self.actor, self.rank = actor, rank

    @property
    def run_steps(self):
        rank, method = self.rank, self.actor.run_steps

        class Bound:
            def __init__(self, opts=None):
                self.opts = opts or {}

            def options(self, **opts):
                return Bound(opts)

            def remote(self, *args):
                return method.options(**self.opts).remote(rank, *args)
        return Bound()


@pytest.fixture(scope="module")
def actors(ray_local):
    cls = ray.remote(num_cpus=0, max_concurrency=16)(Ranks)
    return [cls.remote(0.05) for _ in range(2)]


def ranks_of(actors):
    return [Rank(actors[r % 2], r) for r in range(LAYOUT.world_size)]


def events(actors):
    logs = ray.get([a.record.remote() for a in actors])
    return [e for log, _ in logs for e in log], max(o for _, o in logs)


def test_a_call_behind_starts_after_every_rank_ended_the_one_before(actors):
    first = StepStream(ranks_of(actors), LAYOUT, 100, 2, 0, timeout=30)
    second = first.then(3, 0)
    got = [(s.step, [r["rank"] for r in s.records]) for s in first] + \
          [(s.step, [r["rank"] for r in s.records]) for s in second]
    assert got == [(step, [0, 1, 2, 3]) for step in range(100, 105)]
    log, overlap = events(actors)
    last_end = max(t for _, start, kind, t in log if start == 100 and kind == "end")
    starts = [t for _, start, kind, t in log if start == 102 and kind == "start"]
    assert len(starts) == 4 and min(starts) >= last_end and overlap == 1


def test_a_cancelled_call_behind_never_starts(actors):
    first = StepStream(ranks_of(actors), LAYOUT, 200, 2, 0, timeout=30)
    second = first.then(2, 0)
    second.cancel()
    assert [s.step for s in first] == [200, 201]
    with pytest.raises(Exception):
        list(second)
    second.drain()
    log, _ = events(actors)
    assert not [e for e in log if e[1] == 202]


def test_a_lost_rank_stops_the_call_behind_on_every_rank(ray_local):
    cls = ray.remote(num_cpus=0, max_concurrency=16)(Ranks)
    mine = [cls.remote(0.2) for _ in range(2)]
    first = StepStream(ranks_of(mine), LAYOUT, 300, 3, 0, timeout=30)
    second = first.then(2, 0)
    steps = iter(first)
    next(steps)
    ray.kill(mine[1])  # ranks 1 and 3 die in step 301
    with pytest.raises(ray.exceptions.RayActorError):
        list(steps)
    with pytest.raises(Exception):
        list(second)
    first.drain()
    second.drain()
    log, _ = ray.get(mine[0].record.remote())
    assert not [e for e in log if e[1] == 303], "the call behind ran on a survivor"
