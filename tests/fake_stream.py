"""A streamed step call of the fake group (tests/fakes.py): the steps it runs move every worker's x, and the
faults the fake cluster has scheduled happen in them."""
from ray.exceptions import RayActorError, RayTaskError

from fake_state import Ref, _ids, delta, state_of
from raytp.runtime.cluster.streaming import StepRecords
from raytp.runtime.errors import WorkerAborted


class FakeStream:
    """A streamed call, numbered (``seq``) as StepStream numbers them; `after`: the number of the call it
    was submitted behind (StepStream.then). As in raytp.runtime.worker.calls, it starts only where that
    call is each worker's newest and ended well at this call's start, with the process groups kept
    since; else it fails without a step."""

    def __init__(self, group, start, count, snap, after=None):
        self.group, self.start, self.count, self.snap, self.after = group, start, count, snap, after
        self.seq = next(_ids)

    def then(self, count, snap):
        return FakeStream(self.group, self.start + self.count, count, snap, after=self.seq)

    def drain(self, timeout=1.0):
        pass

    def excuse(self, ranks):
        self.excused = set(ranks)  # (no heartbeat here: a fake rank never hangs)

    def __iter__(self):
        cluster, lay, ws = self.group.placer, self.group.layout, self.group.workers
        if self.after is not None and any((w.newest, w.ended_at) != (self.after, self.start) for w in ws):
            raise RayTaskError("run_steps", "(fake)", WorkerAborted("the call before failed: not started"))
        for w in ws:
            w.newest, w.ended_at = self.seq, None
        cluster.clock += 1
        cluster.calls.append((self.start, self.count, self.after is not None))
        for step in range(self.start, self.start + self.count):
            if step in cluster.during:
                cluster.during.pop(step)()
            if not all(w.alive for w in ws):
                raise RayActorError()
            if step in cluster.failing_steps:
                raise RayTaskError("run_steps", "(fake)", ZeroDivisionError(f"a bug at step {step}"))
            if step in cluster.returns:
                cluster.give(cluster.returns.pop(step))
            dead, slots = cluster.deaths.pop(step, ([], 0))
            if dead:
                self.group.kill(dead)
                cluster.take(slots)
                raise RayActorError()
            for w in ws:
                w.x += delta(step)
                w.completed = step + 1
            recs = [{"step": step, "loss": 1.0 / (1.0 + w.x), "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.001,
                     "comm_s": 0.0, "snapshot_s": cluster.snapshot_s} for w in ws]
            for w, rec in zip(ws, recs):
                w.kept[step] = rec
            parts = {}
            if self.snap and (step + 1) % self.snap == 0:
                parts = {t: Ref(state_of(ws[lay.rank(tp=t)].x)) for t in range(lay.tp)}
            if step == self.start + self.count - 1:
                for w in ws:  # the workers are done with it (before the driver reads its last step)
                    w.ended_at = step + 1
            yield StepRecords(step, recs, parts)
