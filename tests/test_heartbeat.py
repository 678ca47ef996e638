"""The heartbeat's verdict (pure) and, on Ray, a stopped worker found by it in about recovery.hang_s while a
worker that is merely slow, or a machine that is, draws none."""
import os
import signal
import sys
import time

import pytest

from raytp.runtime.cluster.health import Heartbeat, RanksHung, verdict


def test_a_rank_silent_while_every_other_answers_quickly_is_hung():
    assert verdict({0: 0.01, 1: 0.02, 3: 0.01}, 4, 1.0) == [2]
    assert verdict({0: 0.01}, 3, 1.0) == [1, 2]


def test_a_rank_excused_is_never_hung_and_the_others_still_are():
    """A rank tracing a profile (torch's profiler holds the GIL while it writes) is excused; one beside it is not."""
    assert verdict({0: 0.01, 2: 0.01, 3: 0.01}, 4, 1.0, excused={1}) == []
    assert verdict({0: 0.01, 3: 0.01}, 4, 1.0, excused={1}) == [2]


@pytest.mark.parametrize("answered", [{0: 0.01, 1: 0.3, 3: 0.01},  # the others slow: the machine is, no verdict
                                      {},                           # nobody answered: the driver side is slow
                                      {0: 0.01, 1: 0.01, 2: 0.02, 3: 0.01}])  # everyone answered
def test_no_verdict_unless_sure(answered):
    assert verdict(answered, 4, 1.0) == []


class Sleeper:
    """A threaded actor answering pings while another of its threads is busy (as a worker in a collective)."""

    def ping(self):
        return os.getpid()

    def busy(self, s):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < s:  # holds a thread, releases the GIL now and then, as torch does
            time.sleep(0.001)


def verdict_within(beat, seconds):
    """The ranks of the first round's verdict within `seconds` (None if none came)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        beat.last = 0.0
        try:
            beat.check()
        except RanksHung as e:
            return e.ranks
    return None


def test_a_stopped_process_is_found_and_a_busy_one_is_not(ray_local):
    import ray
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path
    actor = ray.remote(Sleeper).options(max_concurrency=4, num_cpus=0)
    workers = [actor.remote() for _ in range(3)]
    pids = ray.get([w.ping.remote() for w in workers])
    busy = workers[1].busy.remote(3.0)
    beat = Heartbeat(workers, 1.0)
    beat.check()  # busy is not hung
    os.kill(pids[2], signal.SIGSTOP)
    try:
        assert verdict_within(beat, 120.0) == [2]  # a round with no verdict (a loaded machine) is asked again
    finally:
        os.kill(pids[2], signal.SIGCONT)
    ray.get(busy)
    for w in workers:
        ray.kill(w)


def test_a_hung_rank_is_ended_only_if_it_is_a_ray_worker():
    """identity.end_process signals only a Ray worker's process (its command line says ``ray::``): never this
    test's own; a pid that is gone is told apart (None: the rank had exited, it died rather than hung)."""
    import subprocess
    import sys
    from raytp.runtime.worker.identity import end_process
    assert end_process(os.getpid()) is False
    assert end_process(2 ** 22 + 12345) is None  # past pid_max's default: no such process
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert end_process(done.pid) is None


def test_an_evaluation_waiting_on_a_stopped_rank_is_cut_short(ray_local):
    """health.watched_get (the driver's wait for an evaluation): a stopped rank raises RanksHung while the
    others' calls still run, long before their end or the timeout."""
    import ray
    from raytp.runtime.cluster.health import watched_get
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(Sleeper).options(max_concurrency=4, num_cpus=0)
    workers = [actor.remote() for _ in range(3)]
    pids = ray.get([w.ping.remote() for w in workers])
    os.kill(pids[1], signal.SIGSTOP)
    try:
        calls = [w.busy.remote(120.0) for w in workers]
        with pytest.raises(RanksHung) as e:
            watched_get(calls, workers, 300.0, 1.0)
        assert e.value.ranks == [1]
        assert not ray.wait([calls[0], calls[2]], num_returns=2, timeout=0)[0], "it waited the others' calls out"
    finally:
        os.kill(pids[1], signal.SIGCONT)
    for w in workers:
        ray.kill(w)
