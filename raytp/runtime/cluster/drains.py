"""Which nodes Ray is draining: a node that will leave (spot preemption with a deadline, the autoscaler's
scale-down, ``ray drain-node``), still running what it has.

Ray marks a node draining when the drain is accepted, stops placing new work there, and ends the node once
nothing runs on it (or whoever asked for the drain ends it at the deadline). A run reads the draining nodes
at its step boundaries (raytp.runtime.recovery.respread) and moves its ranks off them while they still run,
instead of healing their loss after the fact.
"""
from __future__ import annotations


def draining() -> dict[str, float]:
    """{node id (hex): the drain's deadline, Unix seconds (0: none)} of the nodes being drained now; {} when
    Ray cannot say (an older GCS: the ranks' loss is then healed as any other)."""
    import ray
    try:
        got = ray._private.worker.global_worker.gcs_client.get_draining_nodes(timeout=5)
    except Exception:  # noqa: BLE001 - a read that can fail leaves the job as it is
        return {}
    return {(k.hex() if isinstance(k, bytes) else str(k)): float(v) / 1000.0 for k, v in got.items()}
