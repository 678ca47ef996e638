"""Who and where a worker is: for the driver's records and for the prefix of its log lines.

Ray fixes an actor's name when the process starts, but a worker's role changes (a warm spare takes a
rank, an elastic shrink renumbers replicas): ``where`` reports the rank as it is now, with the node,
pid and GPU that lead to it, ``role`` names it, and ``announce`` has Ray's log monitor prefix the
worker's lines with it.
"""
from __future__ import annotations

import os
import signal
import sys


def end_process(pid: int) -> bool | None:
    """SIGKILL process `pid` of this node if it is a Ray worker (its command line says ``ray::``): a rank found
    hung, ended by a live rank beside it (Ray's own kill of a stopped process waits ~5 s for it to exit by
    itself first). True: sent; None: no such process (it had exited: it died, it did not hang); False: not a
    Ray worker's, or this system has no /proc."""
    if not os.path.isdir("/proc/self"):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read().startswith(b"ray::"):
                return False
        os.kill(pid, signal.SIGKILL)
        return True
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return False


def node_ip() -> str:
    """The address this node registered with Ray (127.0.0.1 for a loopback-only cluster)."""
    import ray
    node_id = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def where(rank: int, up: float) -> dict:
    """Node, pid, address and actor name of this process, as Ray and the OS see them, and when it was up
    (wall clock): for the driver's records."""
    import ray
    ctx = ray.get_runtime_context()
    gpus = ctx.get_accelerator_ids().get("GPU", [])
    return {"rank": rank, "actor": ctx.get_actor_name(), "node_id": ctx.get_node_id(), "pid": os.getpid(),
            "ip": node_ip(), "gpu_ids": gpus, "up": up, "device_bytes": device_bytes() if gpus else None}


def device_bytes() -> int | None:
    """The memory of this process's GPU (None without a CUDA device: fake GPUs of a simulated cluster)."""
    import torch
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def role(rank: int, groups) -> str:
    """A worker's current role (an actor's name cannot change: a promoted spare, a renumbered replica)."""
    if rank < 0:
        return "Worker(spare)"
    g = groups
    stage = f", stage {g.pp_rank}/{g.layout.pp}" if g is not None and g.layout.pp > 1 else ""
    at = f", TP rank {g.tp_rank}/{g.layout.tp}{stage}, DP rank {g.dp_rank}/{g.layout.dp}" if g is not None else ""
    return f"Worker(rank {rank}{at})"


def announce(role_text: str) -> None:
    """Tell Ray's log monitor the new role: the prefix of this worker's log lines follows it."""
    line = f":actor_name:{role_text}"  # ray_constants.LOG_PREFIX_ACTOR_NAME
    print(line, flush=True)
    print(line, file=sys.stderr, flush=True)


def kernels(cfg, device) -> dict:
    """The kernels this process's job runs that depend on its device: an MoE job's experts
    (raytp.models.moe.grouped), as the start line names them."""
    if cfg.model.moe is None:
        return {}
    from raytp.models.moe.grouped import expert_kernel
    import torch
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    return {"experts": expert_kernel(torch.device(device).type, dtype)}
