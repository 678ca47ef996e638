"""The client of a run's coordinator (raytp.runtime.coordinator): start it or find it, then follow it.

Following prints the run's output as it is written (the same lines `raytp train` prints without a
coordinator) and ends with its result. SIGTERM of the client files a stop (served at a step boundary, with
a checkpoint) and follows on to the end. Ctrl-C does the same for the client that started the run; a second
Ctrl-C, or the first of `raytp attach`, leaves the run to itself (`Left`).
"""
from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import TextIO

from raytp import names
from raytp.api.errors import BadJob, Interrupted, RunFailed, message_from

POLL_S = 0.25


class Left(Interrupted):
    """The client left the run on Ctrl-C; the run goes on (or stops, if a stop was filed)."""

    def __init__(self, run: str, stopping: bool):
        how = ("it stops at its next step boundary with a checkpoint" if stopping else
               f"it trains on; `raytp stop {run}` stops it")
        KeyboardInterrupt.__init__(self, f"left run {run}: {how}; `raytp attach {run}` follows it again")
        self.run, self.run_dir = run, None


class NotFollowable(LookupError):
    """No run of that name has a coordinator in the cluster."""


class RemoteError(Exception):
    """The error that ended a run in its coordinator: its message, and its traceback as a note."""


def alive(run: str) -> str | None:
    """The refusal of a run name whose coordinator is alive in the connected cluster, else None."""
    from raytp.runtime.coordinator.actor import find
    if find(run) is None:
        return None
    return (f"run {run} is already running in this cluster (its coordinator {names.coordinator(run)} is alive); "
            f"follow it with `raytp attach {run}`, stop it with `raytp stop {run}`, or give another --name")


def follow(actor, run: str, out: TextIO, cursor: int | None, stops: bool, asked: list) -> dict:
    """Print the run's output from `cursor` (None: from now) until it ends; its result. `stops`: a first
    Ctrl-C files a stop (the client that started the run) rather than leaving. `asked`: sigterm_flag's list
    (a SIGTERM that came before the following began is served at once)."""
    import ray
    stopping = False
    while True:
        try:
            if asked and not stopping:
                actor.stop.remote(asked[0])
                stopping = True
            try:
                got = ray.get(actor.follow.remote(cursor), timeout=60)
            except ray.exceptions.RayActorError:
                raise RunFailed(f"the coordinator of run {run} was lost (its node left the cluster?); its "
                                "run directory keeps every record so far, and --resume continues from its "
                                "newest checkpoint", None) from None
            except ray.exceptions.GetTimeoutError:
                continue
            for line in got["lines"]:
                print(line, file=out, flush=True)
            cursor = got["cursor"]
            if got["result"] is not None:
                try:
                    actor.close.remote()
                except Exception:  # noqa: BLE001 - it ends by itself after a while
                    pass
                return got["result"]
            time.sleep(POLL_S)
        except KeyboardInterrupt:
            if not stops or stopping:
                raise Left(run, stopping) from None
            actor.stop.remote("interrupt")
            stopping = True
            print("[raytp] stopping the run at its next step boundary with a checkpoint (Ctrl-C again leaves "
                  f"it to stop by itself; `raytp attach {run}` follows it)", file=out, flush=True)


def outcome(result: dict, run_dir) -> dict:
    """The summary of a run that ended, as Driver.run_to_end returns it plus `checkpoint` and `layout`;
    BadJob or RunFailed for one that failed (the coordinator's traceback as a note of its cause)."""
    if "error" not in result:
        return result
    message = message_from(*result["exception"])
    cause = RemoteError(message)
    cause.add_note(f"in the run's coordinator:\n{result['traceback']}")
    if result["error"] == "bad":
        raise BadJob(message) from cause
    raise RunFailed(message, run_dir) from cause


def start(plan, t0_wall: float):
    """Start the coordinator of `plan`'s run (raytp.api.job.Plan) and begin the run; its handle."""
    from raytp.runtime.coordinator import actor as coordinator
    try:
        return coordinator.start(plan.cfg, plan.run_dir.resolve(), plan.run, plan.init_state, t0_wall)
    except Exception as e:  # noqa: BLE001 - a coordinator that could not start: the run never began
        from raytp.api.errors import message_of
        raise RunFailed(f"the run's coordinator did not start: {message_of(e)}", plan.run_dir) from e


def attach(run: str, out: TextIO, asked: list | None = None) -> dict:
    """Follow the running `run` from now to its end (connected to its cluster already); its summary.
    `asked`: sigterm_flag's list (none: SIGTERM is left to the caller)."""
    import ray
    from raytp.runtime.coordinator.actor import find
    actor = find(run)
    if actor is None:
        raise NotFollowable(f"no run named {run!r} with a coordinator in this cluster (see `raytp status`; a run "
                            "with an embedded Ray ends with the process that started it)")
    now = ray.get(actor.follow.remote(None), timeout=60)
    if now["result"] is None:
        print(f"[raytp] attached to run {run} at step {now['step']}/{now['steps']} (its earlier output: "
              f"{now['run_dir']}/driver.log)", file=out, flush=True)
    result = now["result"]
    if result is None:
        result = follow(actor, run, out, now["cursor"], False, [] if asked is None else asked)
    return {**outcome(result, now["run_dir"]), "run_dir": now["run_dir"]}


@contextmanager
def sigterm_flag():
    """A list that SIGTERM appends "SIGTERM" to, from now until the client ends (main thread only; else it
    stays empty): installed once the client is connected (ray.init sets a handler of its own) and before the
    coordinator starts, so that a `ray job stop` during the start is a stop filed, not a client killed with its
    run left to the orphan timeout."""
    asked: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield asked
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: asked.append("SIGTERM"))
    try:
        yield asked
    finally:
        signal.signal(signal.SIGTERM, previous)
