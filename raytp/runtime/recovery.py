"""Healing a job that lost workers, without losing a step where it can be helped.

1. Detect. A dead worker process fails its streamed step call at once (Ray
   tells the driver); a hung one (stopped, stuck) makes the call miss its
   deadline. Then every worker is pinged: an answer means alive (workers are
   threaded actors, so they answer even while blocked in a collective), an
   ActorDiedError means dead, silence past ``recovery.ping_timeout_s`` means
   hung, and a hung worker is killed.
2. Get the survivors out. gloo has no abort that unblocks a collective
   (../shared/FINDINGS.md), so raytp makes the failure travel: a rank whose
   collective fails destroys its process groups, which closes its sockets, so
   the ranks blocked on *it* fail next, and so on through every group; the
   dead process's own sockets start the chain (a hung one's, once killed).
   Survivors keep their processes, weights and optimizer state.
3. Replace. A lost rank takes a ready warm spare on its TP peers' node if
   the job keeps spares (raytp.runtime.spares), else it is started again in
   its placement-group bundle (Ray re-places a lost node's bundles once
   capacity returns).
4. Restore, fastest source first: a DP replica of the lost shard among the
   survivors (no step lost); else the newest in-memory snapshot (everyone
   rolls back to it if the survivors are ahead); else, when the snapshot went
   down with its node, its copy on another node (raytp.runtime.snapshots);
   else the newest checkpoint.
   Data and dropout are functions of the step, so the replay is exact.
5. Rewire: new groups at a new rendezvous; survivors ``rejoin``, new workers
   ``setup``. Training resumes; the first completed step logs ``recovered``.
"""
from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, OwnerDiedError, RayActorError, RayTaskError

from raytp.runtime import placement
from raytp.train import checkpoint


class StepDeadline(RuntimeError):
    """No worker finished a step within runtime.step_timeout_s: someone may hang."""


class RecoveryFailed(RuntimeError):
    """Workers were lost and could not be replaced or restored."""


class JobError(RuntimeError):
    """A step failed while every worker is alive: an error of the job itself (its code, its data),
    which a recovery would only repeat."""


FAILURES = (RayActorError, RayTaskError, GetTimeoutError, StepDeadline, ObjectLostError, OwnerDiedError)


def recover(d, error: BaseException) -> None:
    """Heal driver `d` after `error`; a failure during recovery starts it again (and counts)."""
    t0 = time.perf_counter()
    while True:
        try:
            _recover_once(d, error, t0)
            return
        except FAILURES as e:
            d._say(f"failure during recovery: {type(e).__name__}: {str(e)[:200]}")
            error = e


def find_lost(d) -> dict[int, str]:
    """{rank: "died" | "hung"} of the workers that no longer serve; hung ones are killed."""
    pings = [w.ping.remote() for w in d.workers]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=d.cfg.recovery.ping_timeout_s)
    lost = {}
    for rank, ref in enumerate(pings):
        if ref not in ready:
            lost[rank] = "hung"
            ray.kill(d.workers[rank], no_restart=True)
            continue
        try:
            ray.get(ref)
        except RayActorError:
            lost[rank] = "died"
    return lost


def wait_out(d, survivors: list[int], lost: dict[int, str]) -> dict[int, int]:
    """Wait until no survivor is inside a step; {rank: completed steps}. A survivor that does not get
    out within runtime.collective_timeout_s is killed and counted as lost (its state is then restored
    like any lost rank's)."""
    deadline = time.monotonic() + d.cfg.runtime.collective_timeout_s
    completed: dict[int, int] = {}
    pending = list(survivors)
    while pending:
        statuses = ray.get([d.workers[r].status.remote() for r in pending], timeout=d.cfg.recovery.ping_timeout_s)
        for r, st in zip(list(pending), statuses):
            if not st["running"]:
                completed[r] = st["completed"]
                pending.remove(r)
        if pending and time.monotonic() > deadline:
            for r in pending:
                ray.kill(d.workers[r], no_restart=True)
                lost[r] = "stuck"
            break
        if pending:
            time.sleep(0.02)
    for r in completed:
        d.workers[r].leave_groups.remote()
    return completed


def _recover_once(d, error: BaseException, t0: float) -> None:
    cfg, lay = d.cfg, d.layout
    lost = find_lost(d)
    if not lost:  # every worker is alive: not a lost worker but an error of the job itself
        cause = getattr(error, "cause", None) or error  # a RayTaskError carries the worker's exception
        raise JobError(f"a step failed with every worker alive: {type(cause).__name__}: {cause}") from error
    survivors = [r for r in range(lay.world_size) if r not in lost]
    completed = wait_out(d, survivors, lost)
    survivors = [r for r in survivors if r not in lost]
    for rank, cause in lost.items():
        d.failures += 1
        where = d.placement[rank] if rank < len(d.placement) else {}
        d.log.event("failure", rank=rank, node=where.get("node_id"), pid=where.get("pid"), cause=cause,
                    step=d.step, error=f"{type(error).__name__}: {str(error)[:300]}")
        d._say(f"rank {rank} {cause} (pid {where.get('pid')}) at step {d.step}; recovering")
    if d.failures > cfg.recovery.max_failures:
        give_up(d, f"{d.failures} worker losses exceed recovery.max_failures={cfg.recovery.max_failures}")

    placement.kill(d.workers[rank] for rank in lost)  # also frees the actors' names for the replacements
    promoted = d.spares.take(list(lost))  # warm spares first: no process to start
    ray.get([s.actor.assume.remote(r, d.cfg.to_dict()) for r, s in promoted.items()],
            timeout=cfg.recovery.ping_timeout_s)
    for rank, spare in promoted.items():
        d.workers[rank] = spare.actor
        d.bundles[spare.actor._actor_id.hex()] = (spare.pg.id.hex(), spare.index)
        d._say(f"rank {rank} is taken over by warm spare {spare.name}")
    for rank in lost:
        if rank not in promoted:
            d.workers[rank] = d.new_worker(rank)
    try:
        ray.get([d.workers[r].ping.remote() for r in lost], timeout=cfg.recovery.replace_timeout_s)
    except GetTimeoutError:
        why = (f"no capacity to replace rank(s) {sorted(lost)} within "
               f"recovery.replace_timeout_s={cfg.recovery.replace_timeout_s:g}s")
        if not shrink(d, lost, completed, t0):
            give_up(d, why)
        return
    snap_nodes = {d.placement[r].get("node_id") for r in lay.tp_group(0) if r < len(d.placement)}
    d.wire(fresh=set(lost))
    step, source = restore(d, lost, completed)
    if source == "snapshot" and not snap_nodes & {n["NodeID"] for n in ray.nodes() if n.get("Alive")}:
        source = "snapshot copy"  # its own node is gone: Ray served the copy kept on another node
    ahead = max(completed.values(), default=step)
    if d.partial is not None and d.partial["step"] == d.step and step > d.step:
        d.log_step(d._record(d.partial, [d.partial]))  # the step the survivors finished as the rank died
    d.healing = {"t0": t0, "lost_steps": max(ahead - step, 0), "source": source, "ranks": sorted(lost),
                 "spares": sorted(s.name for s in promoted.values())}
    d.step = step


def restore(d, lost: dict[int, str], completed: dict[int, int]) -> tuple[int, str]:
    """Give the new workers their shards (and roll back the others if needed); (step, source)."""
    lay, timeout = d.layout, d.cfg.runtime.step_timeout_s
    steps = set(completed.values())
    donors = {}
    for r in lost:
        tp_rank = lay.coords(r)[1]
        donors[r] = next((s for s in completed if lay.coords(s)[1] == tp_rank), None)
    if len(steps) == 1 and all(v is not None for v in donors.values()):
        c = steps.pop()
        ray.get([d.workers[r].set_shard.remote(d.workers[donors[r]].get_state.remote(), c) for r in lost],
                timeout=timeout)
        return c, "replica"
    copies = [("snapshot", lambda: d.snapshots.latest()),
              ("snapshot copy", lambda: d.snapshot_copy.refs(lay.tp))]  # the off-node copy, if one is kept
    for source, newest in copies:
        snap = newest()
        if snap is None:
            continue
        k, refs = snap
        if steps == {k}:  # survivors are at the snapshot: only the new workers load
            targets = list(lost)
        else:             # survivors are ahead (or disagree): everyone rolls back to it
            targets = range(lay.world_size)
        try:
            ray.get([d.workers[r].set_shard.remote(refs[lay.coords(r)[1]], k) for r in targets], timeout=timeout)
            return k, source
        except (ObjectLostError, OwnerDiedError, RayTaskError) as e:
            d._say(f"{source} of step {k} unavailable ({type(e).__name__}); trying the next source")
            steps = set()  # some workers may have loaded it: whatever comes next, everyone loads
    try:
        path, manifest, full = checkpoint.load_latest(d.ckpt_root, warn=d._say)
    except checkpoint.CheckpointError as e:
        raise RecoveryFailed(f"no DP replica, snapshot or checkpoint holds the lost shard(s) {sorted(lost)}: {e}")
    d.set_state(full)
    return manifest["step"], f"checkpoint {path}"


def shrink(d, lost: dict[int, str], completed: dict[int, int], t0: float) -> bool:
    """Elastic shrink: drop the replicas that lost workers, keep training on the others (renumbered
    in order), down to parallel.min_dp. False if the job is not elastic or too few replicas are whole."""
    from raytp.runtime import resize
    cfg, lay = d.cfg, d.layout
    broken = {lay.coords(r)[0] for r in lost}
    whole = [q for q in range(lay.dp) if q not in broken]
    steps = {completed[r] for q in whole for r in lay.tp_group(q)}
    floor = cfg.parallel.min_dp
    sizes = [k for k in range(len(whole), 0, -1) if floor is not None and k >= floor
             and cfg.train.batch_size % k == 0]
    if not sizes or len(steps) != 1:
        return False
    new_dp, old = sizes[0], {"tp": lay.tp, "dp": lay.dp}
    keep = whole[:new_dp]
    drop = [r for q in range(lay.dp) if q not in keep for r in lay.tp_group(q)]
    for r in drop:
        ray.kill(d.workers[r], no_restart=True)
    placement.release(d.pgs[q] for q in range(lay.dp) if q not in keep)
    new_cfg = resize.resized_config(cfg, lay.tp, new_dp)
    workers = [d.workers[r] for q in keep for r in lay.tp_group(q)]
    pgs = {i: d.pgs[q] for i, q in enumerate(keep)}
    resize._switch(d, new_cfg, pgs)
    d.workers = workers
    d.wire(set(), job=new_cfg.to_dict(), renumber=True)
    d.step = steps.pop()
    d.resizing = {"t0": t0, "old": old, "new": {"tp": lay.tp, "dp": new_dp}, "bytes": 0,
                  "reason": f"lost capacity; kept replicas {keep} of {old['dp']}"}
    d._say(f"no capacity for the lost workers: continuing at {d.layout} (grows back to DP={d.target_dp} "
           "when capacity returns)")
    d.healing = {"t0": t0, "lost_steps": 0, "source": f"shrink to DP={new_dp}", "ranks": sorted(lost)}
    return True


def healed(d) -> None:
    """The first completed step after a recovery: log how long it took and what was lost."""
    h, d.healing = d.healing, None
    seconds = time.perf_counter() - h["t0"]
    d.log.event("recovered", seconds=seconds, lost_steps=h["lost_steps"], source=h["source"], ranks=h["ranks"],
                step=d.step, spares=h.get("spares", []))
    d._say(f"recovered in {seconds:.1f}s from {h['source']}, {h['lost_steps']} step(s) lost")


def give_up(d, reason: str) -> None:
    """Fail with a clear message, leaving a whole checkpoint from the newest snapshot if it is newer."""
    note = ""
    snap = d.snapshots.latest()
    newest = checkpoint.list_checkpoints(d.ckpt_root)
    newest_step = int(newest[-1].name.split("-")[1]) if newest else -1
    if snap is not None and snap[0] > newest_step:
        try:
            shards = [checkpoint.unpack_state(s) for s in ray.get(snap[1], timeout=d.cfg.runtime.step_timeout_s)]
            step, d.step = d.step, snap[0]
            note = f"; saved the newest snapshot as {d.save_checkpoint(shards)}"
            d.step = step
        except FAILURES + (checkpoint.CheckpointError,) as e:
            note = f"; the newest snapshot could not be saved ({type(e).__name__})"
    elif newest:
        note = f"; newest checkpoint: {newest[-1]}"
    raise RecoveryFailed(reason + note)
