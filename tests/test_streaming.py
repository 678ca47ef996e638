"""StepStream on real Ray, with a call submitted behind another (``then``): Ray hands it to every rank while
the call before runs, each rank starts it only once its own part of that call has ended (never two at
once), and not at all where that part failed or a peer was lost; a step's records come from the
reporting ranks only, the others' ends and errors are read all the same, and a drained stream leaves
nothing unread. The actors are small threaded stand-ins for raytp's Worker:
the same streaming protocol and the same call order (raytp.runtime.worker.calls, one ``Calls`` per
rank), steps that sleep and then meet a rank of the other actor (a ping: it fails once that actor is
gone, as a collective does), so what is tested is the call order on Ray, not training."""
import sys
import threading
import time

import pytest
import ray
from ray.exceptions import RayActorError, RayTaskError

from raytp.parallel.layout import Layout
from raytp.runtime.cluster import relay as relay_calls
from raytp.runtime.cluster.streaming import StepStream
from raytp.runtime.errors import WorkerAborted
from raytp.runtime.worker.calls import Calls

LAYOUT = Layout(2, dp=2)  # ranks 0 and 2 on one actor, 1 and 3 on the other
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class travels with its calls


class Ranks:
    """Serves run_steps for several ranks (threaded, as raytp's workers are); keeps (rank, start, what, time)
    of every call ("arrived", "started", "ended") and how many calls of a rank ran at once at most.
    Steps in `held` wait until released; steps in `failing` fail on every rank here."""

    def __init__(self, step_s):
        self.step_s, self.calls, self.log = step_s, {}, []
        self.running, self.overlap = {}, 0
        self.held, self.failing, self.peer = set(), set(), None
        self.cond = threading.Condition()

    def meet(self, peer):
        self.peer = peer

    def ping(self):
        return True

    def hold(self, step):
        with self.cond:
            self.held.add(step)

    def release(self, step):
        with self.cond:
            self.held.discard(step)
            self.cond.notify_all()

    def fail_at(self, step, rank=None):
        """Every rank here fails at `step`, or only `rank` (after the step's collective)."""
        self.failing.add(step if rank is None else (rank, step))

    def arrived(self, start, n, timeout):
        """Whether `n` calls from step `start` reached this actor within `timeout` seconds."""
        with self.cond:
            return self.cond.wait_for(lambda: sum(e[1:3] == (start, "arrived") for e in self.log) >= n, timeout)

    def _note(self, rank, start, what, change=0):
        with self.cond:
            self.log.append((rank, start, what, time.time()))
            self.running[rank] = self.running.get(rank, 0) + change
            self.overlap = max(self.overlap, self.running[rank])
            self.cond.notify_all()

    def run_steps(self, rank, start, count, snapshot_every, seq, after=None, report=True, relay=None):
        peers = relay_calls.forward(relay, (start, count, snapshot_every, seq, after)) if relay else []
        try:
            yield from self._own(rank, start, count, seq, after, report)
        except BaseException:
            relay_calls.collect(peers, raising=False)
            raise
        relay_calls.collect(peers)

    def _own(self, rank, start, count, seq, after, report):
        self._note(rank, start, "arrived")
        calls = self.calls.setdefault(rank, Calls())
        calls.begin(seq, start, after)
        self._note(rank, start, "started", +1)
        at = None
        try:
            for step in range(start, start + count):
                with self.cond:
                    self.cond.wait_for(lambda: step not in self.held)
                time.sleep(self.step_s * (1 + rank % 2))  # odd ranks end later
                if step in self.failing or (rank, step) in self.failing:
                    raise WorkerAborted(f"rank {rank} left step {step}")
                ray.get(self.peer.ping.remote(), timeout=30)  # the step's collective with the other actor
                if report:
                    yield {"step": step, "rank": rank}
            at = start + count
        finally:
            self._note(rank, start, "ended", -1)
            calls.end(seq, at)

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


def pair(step_s):
    cls = ray.remote(num_cpus=0, max_concurrency=16)(Ranks)
    actors = [cls.remote(step_s) for _ in range(2)]
    ray.get([actors[0].meet.remote(actors[1]), actors[1].meet.remote(actors[0])])
    return actors


@pytest.fixture(scope="module")
def actors(ray_local):
    return pair(0.05)


def ranks_of(actors):
    return [Rank(actors[r % 2], r) for r in range(LAYOUT.world_size)]


def events(actors):
    logs = ray.get([a.record.remote() for a in actors])
    return {(rank, start, what): t for log, _ in logs for rank, start, what, t in log}, max(o for _, o in logs)


def all_read(*streams):
    """Whether nothing is left in any rank's stream (no record, no error) for Ray to report."""
    return all(next(s, None) is None for stream in streams for s in stream.streams.values())


def test_a_call_behind_reaches_every_rank_early_and_starts_there_once_the_call_before_ended(actors):
    ray.get([a.hold.remote(101) for a in actors])  # the first call's last step waits for the check below
    first = StepStream(ranks_of(actors), LAYOUT, 100, 2, 0, timeout=30)
    second = first.then(3, 0)
    assert all(ray.get([a.arrived.remote(102, 2, 30) for a in actors])), "not handed over during the call before"
    ray.get([a.release.remote(101) for a in actors])
    got = [(s.step, [r["rank"] for r in s.records]) for s in first] + \
          [(s.step, [r["rank"] for r in s.records]) for s in second]
    assert got == [(step, [0]) for step in range(100, 105)]  # rank 0 reports; 1-3 are read at each call's end
    t, overlap = events(actors)
    for rank in range(LAYOUT.world_size):
        assert t[rank, 102, "arrived"] < t[rank, 100, "ended"] <= t[rank, 102, "started"]
    assert overlap == 1 and all_read(first, second)


def test_where_the_call_before_failed_the_call_behind_fails_without_a_step(actors):
    ray.get([a.fail_at.remote(201) for a in actors])  # every rank leaves step 201 (a failed collective)
    first = StepStream(ranks_of(actors), LAYOUT, 200, 3, 0, timeout=30)
    second = first.then(2, 0)
    steps = iter(first)
    assert next(steps).step == 200
    with pytest.raises(RayTaskError, match="left step 201"):
        next(steps)
    with pytest.raises(RayTaskError, match="not started: call .* failed"):
        list(second)
    first.drain()
    second.drain()
    assert all(ray.get([a.arrived.remote(203, 2, 30) for a in actors]))
    t, _ = events(actors)
    assert not [key for key in t if key[1:] == (203, "started")] and all_read(first, second)


def test_a_lost_actor_fails_the_call_behind_on_the_survivors(ray_local):
    mine = pair(0.05)
    ray.get(mine[0].hold.remote(302))  # the survivors' last step of the first call waits for the loss
    first = StepStream(ranks_of(mine), LAYOUT, 300, 3, 0, timeout=30)
    second = first.then(2, 0)
    steps = iter(first)
    next(steps)
    assert ray.get(mine[0].arrived.remote(303, 2, 30))
    ray.kill(mine[1])  # ranks 1 and 3 die
    ray.get(mine[0].release.remote(302))
    with pytest.raises((RayActorError, RayTaskError)):
        list(steps)
    with pytest.raises((RayActorError, RayTaskError)):
        list(second)
    first.drain()
    second.drain()
    log, overlap = ray.get(mine[0].record.remote())
    assert not [e for e in log if e[1:3] == (303, "started")], "the call behind ran on a survivor"
    assert overlap == 1 and all_read(first, second)


def test_a_quiet_rank_that_fails_in_a_calls_last_step_fails_that_step(actors):
    """Ranks 1-3 yield no records; rank 3 fails after its last step's collective: the call's last step
    is not counted, the error is rank 3's."""
    ray.get(actors[1].fail_at.remote(402, rank=3))
    stream = StepStream(ranks_of(actors), LAYOUT, 400, 3, 0, timeout=30)
    steps = iter(stream)
    assert [next(steps).step, next(steps).step] == [400, 401]
    with pytest.raises(RayTaskError, match="rank 3 left step 402"):
        next(steps)
    stream.drain()
    assert all_read(stream)


def test_a_quiet_rank_that_dies_mid_call_is_seen_while_the_reporters_wait(ray_local):
    """Rank 1's actor is killed while rank 0 is held in a step (as a collective on NCCL would hang): the
    driver, waiting on rank 0's record, finds the dead quiet rank without waiting for the step timeout."""
    mine = pair(0.05)
    ray.get(mine[0].hold.remote(501))
    stream = StepStream(ranks_of(mine), LAYOUT, 500, 3, 0, timeout=120)
    steps = iter(stream)
    assert next(steps).step == 500
    ray.kill(mine[1])
    t0 = time.perf_counter()
    with pytest.raises((RayActorError, RayTaskError)):
        next(steps)
    assert time.perf_counter() - t0 < 60, "found only at the step timeout"
    ray.get(mine[0].release.remote(501))
    stream.drain()


def relayed(actors):
    """Rank 3 gets its calls through rank 2 (raytp.runtime.cluster.relay), as the driver's group sends them."""
    workers = ranks_of(actors)
    return workers, {2: ([3], ray.put([workers[3]]))}


def test_a_relayed_rank_runs_the_call_and_its_error_comes_through_its_leader(actors):
    workers, relay = relayed(actors)
    first = StepStream(workers, LAYOUT, 600, 2, 0, timeout=30, relay=relay)
    second = first.then(2, 0)
    assert sorted(first.streams) == [0, 1, 2]  # rank 3 is not called from here
    assert [s.step for s in first] + [s.step for s in second] == [600, 601, 602, 603]
    t, overlap = events(actors)
    assert all((3, start, "ended") in t for start in (600, 602)) and overlap == 1
    ray.get(actors[1].fail_at.remote(605, rank=3))
    third = second.then(2, 0)
    with pytest.raises(RayTaskError, match="rank 3 left step 605"):
        list(third)
    third.drain()
    assert all_read(first, second, third)
