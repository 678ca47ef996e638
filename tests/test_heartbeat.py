"""The heartbeat's verdict (pure) and, on Ray, a stopped worker found by it in about recovery.hang_s while a
worker that is merely slow (looked at by a rank beside it: busy), or a machine that is, draws none."""
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

    def __init__(self):
        self.held = None

    def ping(self):
        while self.held and os.path.exists(self.held):  # a busy process slow to answer (the GIL held, a starved CPU)
            pass
        return os.getpid()

    def slow_pings(self, while_exists):
        self.held = str(while_exists)

    def look_at(self, pid, over_s, up=None):
        from raytp.runtime.worker.identity import look_at
        return look_at(pid, over_s, up)

    def busy(self, s):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < s:  # holds a thread, releases the GIL now and then, as torch does
            time.sleep(0.001)


def sleepers(concurrency=4):
    """Three Sleeper actors (threaded) and their pids."""
    import ray
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path
    actor = ray.remote(Sleeper).options(max_concurrency=concurrency, num_cpus=0)
    workers = [actor.remote() for _ in range(3)]
    return workers, ray.get([w.ping.remote() for w in workers])


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
    workers, pids = sleepers()
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


def test_a_pid_another_process_has_now_is_neither_ended_nor_looked_at():
    """A rank's recorded pid outlives its process, and the OS hands pids out again: a process that started after
    the rank said it was up (`up`) is another's (another run's Ray worker, say) and is left alone, "gone" to a
    look; the rank's own process (started before its `up`) is looked at and ended."""
    import subprocess
    from helpers import wait_for
    from raytp.runtime.worker.identity import START_SLACK_S, end_process, look_at, started_at
    t0 = time.time()
    # A process whose command line says ``ray::`` (a Ray worker's, as far as end_process can tell).
    other = subprocess.Popen(["ray::Worker", "-c", "import time; time.sleep(60)"], executable=sys.executable)
    try:
        wait_for(lambda: started_at(other.pid) is not None, "the process did not start")
        assert abs(started_at(other.pid) - t0) < START_SLACK_S + 1  # /proc's start against the wall clock
        earlier = t0 - 10 * START_SLACK_S  # a rank that was up before this process started: not this process
        assert look_at(other.pid, 0.1, up=earlier) == "gone"
        assert end_process(other.pid, up=earlier) is None and other.poll() is None
        assert look_at(other.pid, 0.1, up=time.time()) in ("busy", "idle")  # its own `up`: looked at
        assert end_process(other.pid, up=time.time()) is True
        assert other.wait(timeout=30) == -signal.SIGKILL
    finally:
        other.kill()


def test_a_silent_rank_that_uses_cpu_is_busy_not_hung(ray_local, tmp_path):
    """A rank slow to answer while its process runs (a healthy replacement's first steps on a loaded machine were
    once killed as hung) draws no verdict when a rank beside it can look at it; judged by its silence alone (no
    placement), the same rank is found hung: the look is what tells them apart."""
    import ray
    workers, pids = sleepers(16)
    node = ray.get_runtime_context().get_node_id()
    placement = [{"node_id": node, "pid": pid} for pid in pids]
    held = tmp_path / "held"
    held.touch()
    ray.get(workers[1].slow_pings.remote(held))
    blind = Heartbeat(workers, 0.5)
    assert verdict_within(blind, 120.0) == [1]  # silence alone: taken for a hang
    beat = Heartbeat(workers, 0.5, placement)
    judged, confirmed = [], beat.confirmed
    beat.confirmed = lambda silent, answered: judged.append((silent, confirmed(silent, answered))) or judged[-1][1]
    deadline = time.monotonic() + 120.0
    while len([j for j in judged if j[0] == [1]]) < 3 and time.monotonic() < deadline:
        beat.last = 0.0
        beat.check()  # no RanksHung: rank 1 was looked at and is busy
    assert [j for j in judged if j[0] == [1]][:3] == [([1], [])] * 3  # silent three times, busy each time
    held.unlink()
    ray.get(workers[1].ping.remote())  # answers again
    os.kill(pids[2], signal.SIGSTOP)
    try:
        assert verdict_within(beat, 120.0) == [2]  # stopped: looked at, and hung
    finally:
        os.kill(pids[2], signal.SIGCONT)
    for w in workers:
        ray.kill(w)


def test_a_look_at_a_process_tells_stopped_busy_idle_and_gone():
    """identity.look_at on real processes of this machine, and activity's reading of the two looks."""
    import subprocess
    from raytp.runtime.worker.identity import activity, look_at
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    nap = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        time.sleep(0.5)  # both started
        assert look_at(spin.pid, 0.2) == "busy"
        assert look_at(nap.pid, 0.2) == "idle"
        os.kill(spin.pid, signal.SIGSTOP)
        time.sleep(0.1)
        assert look_at(spin.pid, 0.2) == "stopped"
    finally:
        spin.kill(), nap.kill()
        spin.wait(), nap.wait()
    assert look_at(spin.pid, 0.2) == "gone"
    assert activity((5, "SS"), (5, "SS")) == "idle" and activity((5, "SS"), (6, "SS")) == "busy"
    assert activity((5, "SR"), (5, "SS")) == "busy" and activity((5, "SS"), (5, "SD")) == "busy"
    assert activity((5, "SS"), (5, "TT")) == "stopped" and activity((5, "SS"), None) == "gone"
    assert activity((5, "SS"), (5, "Z")) == "gone"


def test_an_evaluation_waiting_on_a_stopped_rank_is_cut_short(ray_local):
    """health.watched_get (the driver's wait for an evaluation): a stopped rank raises RanksHung while the
    others' calls still run, long before their end or the timeout."""
    import ray
    from raytp.runtime.cluster.health import watched_get
    workers, pids = sleepers()
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


def test_ranks_meeting_with_a_stopped_one_are_cut_short_after_the_ping_timeout(ray_local):
    """health.PingWatch (the driver's wait while the ranks meet in a recovery): a rank up (it answered a ping) and
    stopped then raises RanksHung once its ping has gone unanswered recovery.ping_timeout_s, not after the join's
    timeout; busy ranks answer. A rank not known up (still starting: its ping waits behind its start) is not
    judged before it answers one: the same wait then ends only at its own timeout."""
    import ray
    from raytp.runtime.cluster.health import PingWatch, all_or_first_error
    workers, pids = sleepers()
    os.kill(pids[2], signal.SIGSTOP)
    try:
        calls = [w.busy.remote(120.0) for w in workers]
        with pytest.raises(ray.exceptions.GetTimeoutError):  # rank 2 never answered: starting, not judged
            all_or_first_error(calls, 6.0, PingWatch(workers, 2.0).check)
        t0 = time.monotonic()
        with pytest.raises(RanksHung, match="recovery.ping_timeout_s=2s") as e:
            all_or_first_error(calls, 300.0, PingWatch(workers, 2.0, up=[0, 1, 2]).check)
        assert e.value.ranks == [2] and 2.0 <= time.monotonic() - t0 < 60.0
        assert not ray.wait(calls[:2], num_returns=2, timeout=0)[0], "it waited the others' calls out"
    finally:
        os.kill(pids[2], signal.SIGCONT)
    for w in workers:
        ray.kill(w)
