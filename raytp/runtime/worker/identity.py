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
import time


def end_process(pid: int, up: float | None = None) -> bool | None:
    """SIGKILL process `pid` of this node if it is a Ray worker (its command line says ``ray::``): a rank found
    hung, ended by a live rank beside it (Ray's own kill of a stopped process waits ~5 s for it to exit by
    itself first). True: sent; None: no such process (it had exited: it died, it did not hang), or that pid is
    another process's now (``reused``: `up`, when the rank's process said it was up); False: not a Ray worker's,
    or this system has no /proc."""
    if not os.path.isdir("/proc/self"):
        return False
    if reused(pid, up):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
        look = cpu_and_states(pid)
        if not command and activity(look, look) == "gone":
            return None  # a zombie: it exited (killed), and its parent has not reaped it yet
        if not command.startswith(b"ray::"):
            return False
        os.kill(pid, signal.SIGKILL)
        return True
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return False


# Slack of a process's start time read from /proc (the boot time there is whole seconds) against a wall clock.
START_SLACK_S = 1.0


def _stat_fields(path: str) -> list[str]:
    """The fields of a /proc stat file after the command name (which may hold spaces and parentheses): the
    state is [0]; raises OSError if it is gone."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def started_at(pid: int) -> float | None:
    """When process `pid` started, by the wall clock (/proc: its start in clock ticks after boot, and the boot
    time); None if there is no such process (or no /proc)."""
    try:
        ticks = int(_stat_fields(f"/proc/{pid}/stat")[19])  # field 22, starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def reused(pid: int, up: float | None) -> bool:
    """Whether pid `pid` belongs now to another process than the one that said it was up at `up` (wall clock):
    one that started after it. A rank's recorded pid outlives its process (a replacement not yet in the records,
    a rank gone since), and the OS hands pids out again: a kill or a look at the pid alone could reach another
    run's worker. False when `up` is not known or the process is gone."""
    start = started_at(pid) if up is not None else None
    return start is not None and start > up + START_SLACK_S


def cpu_and_states(pid: int) -> tuple[int, str] | None:
    """(CPU clock ticks process `pid` has used, each of its threads' state letter, main thread first) from
    /proc; None if there is no such process (or no /proc)."""
    try:
        fields = _stat_fields(f"/proc/{pid}/stat")
        states = [fields[0]]
        for tid in os.listdir(f"/proc/{pid}/task"):
            if tid != str(pid):
                try:
                    states.append(_stat_fields(f"/proc/{pid}/task/{tid}/stat")[0])
                except OSError:  # the thread ended meanwhile
                    pass
        return int(fields[11]) + int(fields[12]), "".join(states)
    except (OSError, IndexError, ValueError):
        return None


def activity(first: tuple[int, str] | None, second: tuple[int, str] | None) -> str:
    """What two looks at a silent process (``cpu_and_states``, a while apart) say it is: "gone" (it exited, or
    is a zombie), "stopped" (SIGSTOP, a debugger: hung), "busy" (a thread runs or waits on I/O, or it used CPU
    between the looks: it holds the GIL, or the machine starves it; slow, not hung), "idle" (it sleeps and uses
    no CPU: wedged)."""
    if first is None or second is None or second[1][0] in "ZX":
        return "gone"
    if second[1][0] in "Tt":
        return "stopped"
    if any(s in "RD" for s in first[1] + second[1]) or second[0] > first[0]:
        return "busy"
    return "idle"


def look_at(pid: int, over_s: float, up: float | None = None) -> str:
    """``activity`` of process `pid` of this node, looked at twice `over_s` apart (once if it is stopped or
    gone): for the heartbeat (raytp.runtime.cluster.health), by a rank beside a silent one. "gone" if the pid is
    another process's now (``reused``)."""
    first = cpu_and_states(pid) if not reused(pid, up) else None
    if first is None or first[1][0] in "Tt":
        return activity(first, first)
    time.sleep(over_s)
    return activity(first, cpu_and_states(pid))


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
