"""The run's coordinator: the Driver in a detached actor, so that the run outlives the process that started it.

A run that joins a cluster (``raytp train --address``, a submitted run) is driven by one actor per run,
``raytp.<run>.coordinator`` in the namespace ``raytp``: detached (it outlives the Ray job of the process
that created it), no CPU, on that process's node (the run directory, driver.log and the relative paths of
the job are where they would be without it). It runs ``Driver.run_to_end`` in a thread; workers, placement
groups, snapshots and spares belong to it. The process that started it (the *client*) and any ``raytp
attach`` follow it by polling ``follow``: the output lines since their cursor, and the result at the end.
A client's SIGTERM or Ctrl-C files a stop (``stop``), served at a step boundary with a checkpoint.

A run nobody follows for ``runtime.orphan_timeout_s`` is stopped the same way (``orphaned``, pure), unless
``runtime.detached``. Once it has ended, the coordinator keeps the result for a client to collect (``LINGER_S``,
or ``ALONE_LINGER_S`` when none was following), then exits; a client that collected it ends it at once
(``close``).
"""
from __future__ import annotations

import os
import threading
import time
import traceback

from raytp import names
from raytp.runtime.coordinator.lines import Lines

LINGER_S = 10.0       # how long an ended run's result waits for the client following it (events.jsonl keeps it)
ALONE_LINGER_S = 2.0  # ... when no client was following at the end
FOLLOWING_S = 3.0     # a client seen this recently follows the run (clients poll every 0.25 s)
# The client's variables a Driver reads (trackers, storage credentials, Hugging Face): the coordinator is
# another process, started by Ray, so they are handed to it (and from it to the workers, which Ray gives the
# parent's env_vars). Nothing else: a client's PATH or CUDA_VISIBLE_DEVICES has no business on other nodes.
FORWARDED = ("WANDB_", "MLFLOW_", "TENSORBOARD_", "HF_", "HUGGING_FACE_", "AWS_", "GOOGLE_APPLICATION_CREDENTIALS",
             "AZURE_", "FSSPEC_", "RAYTP_")


def forwarded_env(environ) -> dict[str, str]:
    """The client's environment variables the coordinator is given (FORWARDED prefixes)."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED)}


def orphaned(last_seen: float, now: float, timeout_s: float, detached: bool) -> bool:
    """Whether a run nobody has followed since `last_seen` is to be stopped at `now`."""
    return not detached and now - last_seen > timeout_s


def client_line(last_seen: float, now: float, timeout_s: float, detached: bool) -> str:
    """What `raytp status` says of the run's client."""
    if now - last_seen <= FOLLOWING_S:
        return "following"
    since = time.strftime("%H:%M:%S UTC", time.gmtime(last_seen))
    if detached:
        return f"none since {since} (runtime.detached: runs on)"
    ends = time.strftime("%H:%M:%S UTC", time.gmtime(last_seen + timeout_s))
    return f"none since {since}; stops with a checkpoint at {ends} unless one attaches"


class Coordinator:
    """The actor. `start` begins the run; clients `follow`, `stop` and `close`."""

    def __init__(self, cfg, run_dir: str, run: str, init_state, cwd: str, t0_wall: float):
        if os.path.isdir(cwd):  # the job's relative paths mean what they mean to the client (same machine)
            os.chdir(cwd)
        from raytp.runtime.driver.driver import Driver

        class Coordinated(Driver):
            def view(inner) -> dict:
                return {**super().view(), "client": self.client_line()}

        self.out = Lines()
        self.runtime = cfg.runtime
        self.last_seen = time.time()
        self.result: dict | None = None
        self.t_start = time.perf_counter() - max(0.0, time.time() - t0_wall)  # the client's command began then
        self.driver = Coordinated(cfg, run_dir, run, out=self.out, init_state=init_state)
        self.thread = threading.Thread(target=self._run, name="raytp-driver", daemon=True)

    def start(self) -> int:
        """Begin the run; the cursor of its first line."""
        self.thread.start()
        threading.Thread(target=self._watch, name="raytp-orphan-watch", daemon=True).start()
        return 0

    # -- clients --------------------------------------------------------------------------------
    def follow(self, cursor: int | None) -> dict:
        """Output since `cursor` (None: from now), the new cursor, and the result once the run ended."""
        self.last_seen = time.time()
        lines, cursor = self.out.since(self.out.end if cursor is None else cursor)
        done = self.result is not None
        return {"lines": lines, "cursor": cursor, "result": self.result if done else None,
                "step": self.driver.step, "steps": self.driver.cfg.train.steps,
                "run_dir": str(self.driver.run_dir)}

    def stop(self, via: str) -> None:
        """Stop at the next step boundary with a checkpoint (a client's SIGTERM or Ctrl-C)."""
        self.driver.request_stop(via=via)

    def close(self) -> None:
        """A client collected the result: end now."""
        if self.result is not None:
            threading.Thread(target=self._exit, args=(0.2,), daemon=True).start()

    def client_line(self) -> str:
        return client_line(self.last_seen, time.time(), self.runtime.orphan_timeout_s, self.runtime.detached)

    # -- the run --------------------------------------------------------------------------------
    def _run(self) -> None:
        from raytp.files.storage import StorageError
        from raytp.runtime.errors import DoesNotFit
        d = self.driver
        try:
            summary = d.run_to_end(t_start=self.t_start)
            newest = d.checkpoints.newest() if d.checkpoints.committed is not None else None
            result = {**summary, "checkpoint": newest.where if newest is not None else None, "layout": d.layout}
        except BaseException as e:  # noqa: BLE001 - handed to the client, which raises it as raytp.train does
            kind = "bad" if isinstance(e, (StorageError, DoesNotFit)) else "failed"
            result = {"error": kind, "exception": (type(e).__module__, type(e).__name__, str(e)),
                      "traceback": traceback.format_exc()}
        self.result = result
        following = time.time() - self.last_seen <= FOLLOWING_S
        threading.Thread(target=self._exit, args=(LINGER_S if following else ALONE_LINGER_S,), daemon=True).start()

    def _watch(self) -> None:
        while self.result is None:
            time.sleep(1.0)
            if orphaned(self.last_seen, time.time(), self.runtime.orphan_timeout_s, self.runtime.detached) \
                    and self.driver.controls.stop is None:
                self.driver.say(f"no client has followed the run for {self.runtime.orphan_timeout_s:g}s: "
                                 "stopping it with a checkpoint (runtime.orphan_timeout_s; runtime.detached: "
                                 "true keeps such a run going)")
                self.driver.request_stop(via="orphaned")

    def _exit(self, after_s: float) -> None:
        time.sleep(after_s)
        os._exit(0)


def start(cfg, run_dir, run: str, init_state, t0_wall: float):
    """Create the coordinator of `run` on this process's node and begin the run; its handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(Coordinator).options(
        name=names.coordinator(run), namespace=names.NAMESPACE, lifetime="detached", num_cpus=0,
        max_restarts=0, max_concurrency=8, scheduling_strategy=here,
        runtime_env={"env_vars": forwarded_env(os.environ)},
    ).remote(cfg, str(run_dir), run, init_state, os.getcwd(), t0_wall)
    ray.get(actor.start.remote())
    return actor


def find(run: str):
    """The coordinator of `run` if one is alive in the connected cluster, else None."""
    import ray
    try:
        return ray.get_actor(names.coordinator(run), namespace=names.NAMESPACE)
    except ValueError:
        return None
