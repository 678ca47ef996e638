"""Who and where a worker is: for the driver's records and for the prefix of its log lines.

Ray fixes an actor's name when the process starts, but a worker's role changes (a warm spare takes a
rank, an elastic shrink renumbers replicas): ``where`` reports the rank as it is now, with the node,
pid and GPU that lead to it, and ``_announce`` has Ray's log monitor prefix the worker's lines with it.
"""
from __future__ import annotations

import os


class WorkerIdentity:
    """The Worker's identity methods (it sets rank, groups and up)."""

    @staticmethod
    def _node_ip() -> str:
        """The address this node registered with Ray (127.0.0.1 for a loopback-only cluster)."""
        import ray
        node_id = ray.get_runtime_context().get_node_id()
        return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)

    def where(self) -> dict:
        """Node, pid, address and actor name, as Ray and the OS see them, and when the process was up (wall
        clock): for the driver's records."""
        import ray
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "actor": ctx.get_actor_name(), "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "ip": self._node_ip(), "gpu_ids": ctx.get_accelerator_ids().get("GPU", []),
                "up": self.up}

    def __repr__(self) -> str:
        """Its current role (an actor's name cannot change: a promoted spare, a renumbered replica)."""
        if self.rank < 0:
            return "Worker(spare)"
        g = self.groups
        stage = f", stage {g.pp_rank}/{g.layout.pp}" if g is not None and g.layout.pp > 1 else ""
        where = f", TP rank {g.tp_rank}/{g.layout.tp}{stage}, DP rank {g.dp_rank}/{g.layout.dp}" if g is not None else ""
        return f"Worker(rank {self.rank}{where})"

    def _announce(self) -> None:
        """Tell Ray's log monitor the new role: the prefix of this worker's log lines follows it."""
        import sys
        line = f":actor_name:{self!r}"  # ray_constants.LOG_PREFIX_ACTOR_NAME
        print(line, flush=True)
        print(line, file=sys.stderr, flush=True)
