"""The driver's side of profiling on demand: which ranks trace which steps, and the ``profile`` event once
their traces are written.

A plan (raytp.runtime.worker.profiling.ProfilePlan) comes from the job's ``profile`` section, handed to
its ranks before the first step (``start``), or from ``raytp profile`` through the control actor, served at
a step boundary (``request``: the next N steps, answered at once with where the traces will be). The
ranks write the files themselves; a plan's files are whole once every rank's call that ran its last step
has ended, which the driver knows at the step boundary after it (``poll``): then it logs the event, with
the ranks whose trace is there, and answers the request again, ``written``.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray

from raytp.files.storage import Storage
from raytp.runtime.records import Outcome
from raytp.runtime.worker.profiling import ProfilePlan, trace_file


@dataclass(frozen=True)
class Handed:
    """A plan handed to `ranks`, until its files are written; `request_id`: the request to answer then."""
    plan: ProfilePlan
    ranks: tuple[int, ...]
    request_id: int | None = None


def requested_steps(step: int, total: int, count: int, ranks: list[int], world_size: int,
                    under_way: list[ProfilePlan]) -> tuple[int, int] | str:
    """The steps `raytp profile --steps count` asks for at the boundary before `step` (0-based) of a run of
    `total` steps: (first, last), the last no later than the run's; or why they cannot be traced."""
    if count < 1:
        return f"--steps {count}: give a number of steps >= 1"
    outside = [r for r in ranks if not 0 <= r < world_size]
    if not ranks or outside:
        return (f"--ranks {','.join(map(str, ranks))}: the run has {world_size} rank(s) now; "
                f"valid: 0 to {world_size - 1}")
    if step >= total:
        return f"the run has no steps left to profile (all {total} are done)"
    first, last = step, min(step + count, total) - 1
    for p in under_way:
        if p.first <= last and first <= p.last:
            return f"steps {first}-{last} overlap the profile of steps {p.first}-{p.last} under way; ask after it"
    return first, last


class Profiles:
    def __init__(self, section, storage: Storage, log, say):
        """`section`: the job's ProfileConfig; `storage`: the checkpoint location the ranks write under."""
        self.section, self.storage, self.log, self.say = section, storage, log, say
        self.handed: list[Handed] = []

    def where(self, plan: ProfilePlan) -> str:
        """The folder of `plan`'s files, as a path (a filesystem) or a URL (an object store)."""
        return self.storage.path(plan.folder) if self.storage.local else f"{self.storage.url.rstrip('/')}/{plan.folder}"

    def start(self, group, step: int) -> None:
        """Hand the job's profile section to its ranks before the first step (`step`: where the run starts)."""
        s = self.section
        if s.steps is None:
            return
        first, last = s.steps
        if last < step:
            self.say(f"profile.steps [{first}, {last}] lie before step {step}, where the run starts: nothing "
                     "is profiled")
            return
        why = self._hand(group, ProfilePlan(first, last, s.memory, self.storage.url), sorted(set(s.ranks)))
        if why:
            self.say(f"profile.steps [{first}, {last}]: nothing is profiled: {why}")

    def tracing(self, first: int, last: int) -> set[int]:
        """The ranks that trace any of steps `first`..`last`: their pings may go unanswered for seconds then, as
        torch's profiler holds the GIL (raytp.runtime.cluster.health: excused from the heartbeat)."""
        return {r for h in self.handed if h.plan.first <= last and first <= h.plan.last for r in h.ranks}

    def request(self, group, step: int, total: int, req) -> Outcome:
        """Serve `raytp profile` (`req`: a run_status.ProfileAsked) at the boundary before `step`: trace the next
        `req.steps` steps on `req.ranks` (default [0]); the answer says where the traces will be."""
        ranks, memory, request_id = sorted(set(req.ranks if req.ranks is not None else [0])), req.memory, req.id
        got = requested_steps(step, total, req.steps, ranks, group.layout.world_size, [h.plan for h in self.handed])
        if isinstance(got, str):
            return Outcome.refused(got)
        plan = ProfilePlan(*got, memory, self.storage.url)
        why = self._hand(group, plan, ranks, request_id)
        if why:
            return Outcome.refused(why)
        self.say(f"profiling steps {plan.first}-{plan.last} on rank(s) {', '.join(map(str, ranks))} on request")
        return Outcome(ok=True, step=step, extra={"steps": [plan.first, plan.last], "ranks": ranks,
                                                  "where": self.where(plan), "written": False})

    def _hand(self, group, plan: ProfilePlan, ranks: list[int], request_id: int | None = None) -> str | None:
        """Hand `plan` to `ranks`; None, or why they cannot trace (their torch: nothing is traced then)."""
        try:
            ray.get([group.workers[r].profile.remote(plan) for r in ranks], timeout=group.cfg.runtime.step_timeout_s)
        except ray.exceptions.RayTaskError as e:
            return str(e.cause if isinstance(e.cause, RuntimeError) else e).splitlines()[0]
        self.handed.append(Handed(plan, tuple(ranks), request_id))
        return None

    def poll(self, step: int, answer) -> None:
        """At a step boundary where every rank's calls up to `step` have ended: log the plans whose last step
        came before it, and answer their requests through `answer(request_id, Outcome)`."""
        done = [h for h in self.handed if h.plan.last < step]
        self.handed = [h for h in self.handed if h.plan.last >= step]
        for h in done:
            plan, where = h.plan, self.where(h.plan)
            written = [r for r in h.ranks if self.storage.exists(plan.folder, trace_file(r))]
            missing = [r for r in h.ranks if r not in written]
            self.log.event("profile", steps=[plan.first, plan.last], ranks=written, where=where,
                           memory=plan.memory, **({"missing": missing} if missing else {}))
            self.say(f"profile of steps {plan.first}-{plan.last} written to {where} (rank(s) "
                     f"{', '.join(map(str, written)) or 'none'}" + (f"; none from {missing}" if missing else "") + ")")
            answer(h.request_id, Outcome(ok=bool(written), step=step, error=None if written else
                                         "no rank wrote its trace (see the workers' log)",
                                         extra={"steps": [plan.first, plan.last], "ranks": written, "where": where,
                                                "files": [f"{where}/{trace_file(r)}" for r in written],
                                                "written": True, **({"missing": missing} if missing else {})}))
