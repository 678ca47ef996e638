"""Run a function on N local processes, one per rank, without Ray.

Used by the tests (each rank its own process, as the real thing) and by the
benchmark that times raytp's training without Ray's driver around it.
``fn(rank, world_size, init_method, *args)`` must be importable (module level);
its return values come back in rank order; an exception in any rank is
re-raised here with that rank's traceback.

The processes are forked from a fork server that has imported torch once (multiprocessing's "forkserver"),
not spawned from scratch: each rank is still a fresh process of its own with its own ProcessGroup, but it
starts without importing torch again (~2 s of CPU a rank). The server starts at the first call, and its
processes have the environment (os.environ, sys.path) this process had then.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import time
import traceback

from raytp.parallel.groups import free_port


def _entry(fn, rank, world_size, init_method, args, threads, queue):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    import torch
    if threads:
        torch.set_num_threads(threads)
    try:
        # Plain pickle bytes: the queue's own pickler would pass tensors as shared
        # memory handles, which die with this process.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, init_method, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "raytp.train.step", "raytp.models.shard"]


def run_ranks(world_size: int, fn, *args, threads: int = 1, timeout_s: float = 300.0) -> list:
    """fn on `world_size` new processes; returns [result of rank 0, rank 1, ...]."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call in this process)
    queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init_method, args, threads, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not errors:
            try:
                rank, ok, value = queue.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and queue.empty():
                    errors.append(f"rank(s) {dead} exited without a result (exit codes "
                                  f"{[procs[r].exitcode for r in dead]})")
                elif time.monotonic() > deadline:
                    errors.append(f"no result from ranks {sorted(set(range(world_size)) - set(results))} "
                                  f"within {timeout_s:g}s")
                continue
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")  # the others may be blocked on it
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
