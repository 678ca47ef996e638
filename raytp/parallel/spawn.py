"""Run a function on N local processes, one per rank, without Ray.

Used by the tests (each rank its own process, as the real thing) and by the
benchmark that times raytp's training without Ray's driver around it.
``fn(rank, world_size, init_method, *args)`` must be importable (module level);
its return values come back in rank order; an exception in any rank is
re-raised here with that rank's traceback.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def run_ranks(world_size: int, fn, *args, threads: int = 1, timeout_s: float = 300.0) -> list:
    """fn on `world_size` spawned processes; returns [result of rank 0, rank 1, ...]."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init_method, args, threads, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout_s)
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break  # the others are likely blocked in a collective with it
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
