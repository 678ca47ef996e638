"""Workers with injected faults, shipped to Ray by value (tests/ is not on the workers' path)."""
import os
import sys
import time

import ray
import ray.cloudpickle

from raytp.runtime.worker.worker import Worker


class DiesInSave(Worker):
    """Rank 1 exits as it begins its file of the checkpoint of step 8 (once per test, via a marker file)."""

    marker = ""

    def __init__(self, job, rank):
        super().__init__(job, rank)
        self.marker_path = type(self).marker

    def begin_save(self, url, directory):
        if self.rank == 1 and self.completed == 8 and not os.path.exists(self.marker_path):
            open(self.marker_path, "w").close()
            os._exit(1)
        return super().begin_save(url, directory)


class DiesInResizeSetup(Worker):
    """Rank 2, started by a TP resize (its setup gets the state to slice), exits there (once per test)."""

    marker = ""

    def __init__(self, job, rank):
        super().__init__(job, rank)
        self.marker_path = type(self).marker

    def setup(self, layout, init_method, source=None):
        if source is not None and self.rank == 2 and not os.path.exists(self.marker_path):
            open(self.marker_path, "w").close()
            os._exit(1)
        return super().setup(layout, init_method, source)


class ReplacementDiesInSetup(Worker):
    """Rank `rank`'s first replacement exits as its setup begins, while the survivors wait for it in the
    rendezvous (files `marker`-setup-<n>: one per setup of that rank so far)."""

    rank_of, marker = 1, ""

    def setup(self, layout, init_method, source=None):
        cls = type(self)
        if self.rank == cls.rank_of:
            n = sum(os.path.exists(f"{cls.marker}-setup-{i}") for i in range(8))
            open(f"{cls.marker}-setup-{n}", "w").close()
            if n == 1:
                os._exit(1)
        return super().setup(layout, init_method, source)


HOLD_S = 240.0  # a hold this long means that what it waits for never came (not that it came slowly)


def hold_until(ready, what):
    """Wait until `ready()` is true; RuntimeError naming `what` past HOLD_S."""
    deadline = time.monotonic() + HOLD_S
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {HOLD_S:g}s")
        time.sleep(0.05)


def _answers(name_prefix, method):
    """What `method` of each live actor of this namespace whose name starts with `name_prefix` answers."""
    out = []
    for a in ray.util.list_named_actors():
        if a.startswith(name_prefix):
            try:
                out.append(ray.get(getattr(ray.get_actor(a), method).remote(), timeout=5))
            except (ValueError, ray.exceptions.RayError):  # gone, or not up yet
                pass
    return out


class WaitsForSpare(Worker):
    """Rank 0 holds its step 2 until the warm spare `spare` (an actor name) is up; then every step takes
    at least 0.4 s. The job outlives the spare's start however loaded the machine is, and the steps
    after it leave time to kill a rank."""

    holds_s = HOLD_S  # its peers wait for a held step in its collectives (helpers.run)

    spare = ""

    def _step(self, step, before_update=None):
        t0 = time.perf_counter()
        if self.rank == 0 and step == 2:
            hold_until(lambda: _answers(type(self).spare, "where"), f"the spare {type(self).spare} did not start")
        rec = super()._step(step, before_update)
        time.sleep(max(0.0, 0.4 - (time.perf_counter() - t0)))
        return rec


class WaitsForSnapshotCopy(Worker):
    """Rank 0 holds its step 4 until a snapshot keeper of run `run` holds a snapshot (once per test, via
    a marker file): the copy is in place early in the job however loaded the machine is."""

    holds_s = HOLD_S  # its peers wait for a held step in its collectives (helpers.run)

    run = marker = ""

    def _step(self, step, before_update=None):
        cls = type(self)
        if self.rank == 0 and step == 4 and not os.path.exists(cls.marker):
            hold_until(lambda: [s for s, _ in _answers(f"raytp.{cls.run}.snapshots", "holding") if s is not None],
                       f"no snapshot keeper of {cls.run} held a snapshot")
            open(cls.marker, "w").close()
        return super()._step(step, before_update)


class SlowSaves(Worker):
    """Reports its checkpoint file written 2 s late (a slow filesystem): a save is still in flight at the next
    step boundary."""

    def save_result(self):
        time.sleep(2.0)
        return super().save_result()


class SlowData(Worker):
    """Rank 1 takes `delay_s` longer to build each batch (a slow disk, a busy host): the others wait for it."""
    delay_s = 0.5

    def _micro_batches(self, split, step):
        if self.rank == 1 and split == "train":
            time.sleep(self.delay_s)
        return super()._micro_batches(split, step)


class Buggy(Worker):
    """Its step raises at step 3, on every rank: an error of the job's code, not a lost worker."""

    def _step(self, step, before_update=None):
        if step == 3:
            raise ZeroDivisionError("a bug in the training code")
        return super()._step(step, before_update)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class DiesAfterItsStep(Worker):
    """Each rank of `at` ({rank: step}) exits right after it finished that step (its collectives done, its
    record made) and before the record leaves it: the survivors have finished the step too, and the
    driver never reads its record from this rank. Once per test each (marker files `marker`-rank-step)."""

    at: dict = {}
    marker = ""

    def _step(self, step, before_update=None):
        rec = super()._step(step, before_update)
        path = f"{type(self).marker}-{self.rank}-{step}"
        if type(self).at.get(self.rank) == step and not os.path.exists(path):
            open(path, "w").close()
            os._exit(1)
        return rec


class WaitsForRoom(Worker):
    """Rank 0 holds its step 4 until the node whose id file `node_file` names has a replica's room (`need`)
    free as the driver reads it (or a new group of replica 1 took it already); its step 8 until a placement
    group of replica 1 of run `run` other than those of its first step is placed (the one a move off its twin's
    node asked for); its step 10 until the moved
    workers (``raytp.<run>.rank<R>.moved1`` of replica 1) are up. The move then happens at the boundary
    after step 11 at the latest, however loaded the machine is."""

    holds_s = HOLD_S  # its peers wait for a held step in its collectives (helpers.run)

    run = node_file = ""
    need: dict = {}

    def _step(self, step, before_update=None):
        cls = type(self)
        if self.rank == 0 and not hasattr(self, "first_groups"):  # replica 1's groups before any node joined
            self.first_groups = self._replica1_groups()
        if self.rank == 0 and step == 4:
            from ray._private.state import available_resources_per_node

            def room():  # free, or already taken by the move's group (a loaded machine's driver can be first)
                node = open(cls.node_file).read() if os.path.exists(cls.node_file) else None
                return node and (all(available_resources_per_node().get(node, {}).get(k, 0.0) >= v
                                     for k, v in cls.need.items()) or self._replica1_groups() - self.first_groups)
            hold_until(room, "the added node showed no room")
        if self.rank == 0 and step == 8:
            hold_until(lambda: self._replica1_groups() - self.first_groups,
                       "no placement group for a move of replica 1 was placed")
        if self.rank == 0 and step == 10:
            hold_until(lambda: len(_answers(f"raytp.{cls.run}.rank2.moved1", "where")
                                   + _answers(f"raytp.{cls.run}.rank3.moved1", "where")) == 2,
                       "the moved workers did not start")
        return super()._step(step, before_update)

    def _replica1_groups(self) -> set:
        return {pid for pid, g in ray.util.placement_group_table().items()
                if g.get("name", "").startswith(f"raytp.{type(self).run}.replica1.") and g.get("state") == "CREATED"}


class WaitsForReplicas(Worker):
    """Rank 0 holds step `at[q]` until a placement group of replica q of run `run` is placed (the growth to
    parallel.max_dp asked for it when the job started; a node joining places it), so that the job grows at
    the step boundary after it however loaded the machine is."""

    holds_s = HOLD_S  # its peers wait for a held step in its collectives (helpers.run)

    run = ""
    at: dict = {}

    def _step(self, step, before_update=None):
        cls = type(self)
        for q, at in cls.at.items():
            if self.rank == 0 and step == at:
                hold_until(lambda q=q: any(g.get("name", "").startswith(f"raytp.{cls.run}.replica{q}.")
                                           and g.get("state") == "CREATED"
                                           for g in ray.util.placement_group_table().values()),
                           f"no placement group of replica {q} was placed")
        return super()._step(step, before_update)


class WaitsForMoved(Worker):
    """Rank 0 takes 0.4 s for each step from `slow_from` (steps whose records reach the driver more than a
    second apart: it reads Ray's draining nodes as records arrive, at most once a second) and holds step `at`
    until the workers a move started ahead (``raytp.<run>.rank<R>.moved1`` for each of `ranks`) are up: the
    move then happens at the boundary after that step, however loaded the machine."""

    holds_s = HOLD_S  # its peers wait for a held step in its collectives (helpers.run)

    run = ""
    ranks: tuple = ()
    slow_from, at = 3, 8

    def _step(self, step, before_update=None):
        cls = type(self)
        if self.rank == 0 and cls.slow_from <= step < cls.at:
            time.sleep(0.4)
        if self.rank == 0 and step == cls.at:
            hold_until(lambda: len([a for r in cls.ranks for a in _answers(f"raytp.{cls.run}.rank{r}.moved1", "where")])
                       == len(cls.ranks), "the moved workers did not start")
        return super()._step(step, before_update)


class DiesInItsStep(Worker):
    """Each rank of `at` ({rank: step}) exits in that step as it calls `comm`'s function `dies_in`: by default
    the record's gather, the step's last collective before its update (its peers wait there, none updated);
    "start_all_gather_in_place" under zero 1 is right after its own update (its peers have updated too, or
    are about to, and fail gathering the new weights: their state is torn). Once per test each (marker files
    `marker`-rank-step)."""

    at: dict = {}
    dies_in = "all_gather_float"
    marker = ""

    def _step(self, step, before_update=None):
        path = f"{type(self).marker}-{self.rank}-{step}"
        if type(self).at.get(self.rank) == step and not os.path.exists(path):
            open(path, "w").close()
            from raytp.parallel import comm

            def exit_instead(*args, **kwargs):
                self._leave()
            setattr(comm, type(self).dies_in, exit_instead)
        return super()._step(step, before_update)

    def _leave(self):
        os._exit(1)


class BlockedForGood(Worker):
    """Rank `rank_of` stays inside the step it begins after the file `marker` appears, idle (a sleep standing for a
    collective that never returns, as a gloo all-reduce begun after its peers' pairs failed once did in CI), until
    the recovery ends it; once (it deletes the file)."""

    rank_of, marker = 0, ""

    def _step(self, step, before_update=None):
        if self.rank == type(self).rank_of and os.path.exists(type(self).marker):
            os.remove(type(self).marker)
            time.sleep(3600)
        return super()._step(step, before_update)


class LeavesItsSocketsOpen(DiesInItsStep):
    """DiesInItsStep, but first it hands its process groups' sockets to the process listening at the Unix socket
    `marker`.sock (the test's ``fault_plans.SocketHolder``), which holds them open: as a host that froze or left
    the network, nothing closes them, and peers blocked on it would wait out runtime.collective_timeout_s."""

    def _leave(self):
        import socket
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(f"{type(self).marker}.sock")
            socket.send_fds(s, [b"fds"], sorted(self.groups.sockets))
            s.recv(1)  # the holder has them
        os._exit(1)


class AbortsNothing(LeavesItsSocketsOpen):
    """LeavesItsSocketsOpen, and no rank's abort gets it out of a collective (as once in CI, where a survivor stayed
    ~120 s in its step past the abort): its peers wait out runtime.collective_timeout_s."""

    def abort_collectives(self) -> int:
        return 0


class SocketHolder:
    """The process LeavesItsSocketsOpen hands its sockets to (this test's): they stay open until the block ends."""

    def __init__(self, path: str):
        import socket
        import threading
        self.path, self.fds = path, []
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(path)
        self.server.listen(1)
        self.thread = threading.Thread(target=self._take, daemon=True)

    def _take(self):
        import socket
        conn, _ = self.server.accept()
        with conn:
            _, self.fds, _, _ = socket.recv_fds(conn, 16, 256)
            conn.sendall(b"k")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        for fd in self.fds:
            os.close(fd)
        self.server.close()


class WithholdsItsGather(Worker):
    """Under zero 1 with the gather of new weights overlapped with the next forward pass: each rank of `at`
    ({rank: step}) updates at that step but sends its peers nothing of its new rows, ends the step (its record
    and snapshot part go out), and exits as the next step begins. Its peers ended the step too, then fail in
    the next forward pass waiting for its rows: their weights are torn at a step the snapshots hold. Once per
    test each (marker files `marker`-rank-step)."""

    at: dict = {}
    marker = ""

    def _step(self, step, before_update=None):
        from raytp.parallel import comm
        at = type(self).at.get(self.rank)
        path = f"{type(self).marker}-{self.rank}-{at}"
        if at is not None and step == at + 1 and getattr(self, "withheld", False):
            os._exit(1)
        if at == step and not os.path.exists(path):
            open(path, "w").close()
            self.withheld = True
            comm.start_all_gather_in_place = lambda flat, group: []
        return super()._step(step, before_update)


class DiesInEvaluation(Worker):
    """Rank `eval_rank` exits as the evaluation after `eval_at` steps begins (once per test, marker file
    `eval_marker`): the step before it completed everywhere, and its record is read, but not yet written."""

    eval_rank, eval_at, eval_marker = 1, 12, ""

    def evaluate(self, step):
        cls = type(self)
        if self.rank == cls.eval_rank and step == cls.eval_at and not os.path.exists(cls.eval_marker):
            open(cls.eval_marker, "w").close()
            os._exit(1)
        return super().evaluate(step)


class DiesAtTheEndOfAStep(DiesInItsStep, DiesInEvaluation):
    """Both: DiesInItsStep's exit in a step's last collective, then DiesInEvaluation's in an evaluation."""


class HoldsTheGilInItsExport(Worker):
    """Rank 1 holds the GIL for 2.5 s right after its profile's trace is written (torch's profiler stop and
    ``export_chrome_trace`` hold it for as long as a trace takes: 0.04 s for a tiny one unloaded, seconds for a
    big one or on a loaded machine): its pings go unanswered meanwhile, as a stopped process's would."""

    def _traced_step(self, step, last):
        tracing = self.profiler.active is not None
        rec = super()._traced_step(step, last)
        if self.rank == 1 and tracing and self.profiler.active is None:  # it stopped and wrote its trace
            import ctypes
            ctypes.PyDLL(None).usleep(2_500_000)  # a C call made with the GIL held
        return rec


class DiesInTakeMoves(Worker):
    """A rank a DP change added (rank >= 2) exits as it takes its blocks of the state mover's plan (once per
    test: `marker`, a path): the change rolls back."""

    marker = ""

    def __init__(self, job, rank):
        super().__init__(job, rank)
        self.marker_path = type(self).marker

    def take_moves(self, source, completed):
        if self.rank >= 2 and not os.path.exists(self.marker_path):
            open(self.marker_path, "w").close()
            os._exit(1)
        return super().take_moves(source, completed)
