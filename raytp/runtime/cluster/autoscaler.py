"""What a run asks Ray's autoscaler for: the capacity of the layout it grows to.

A job below its DP target (``parallel.max_dp``, or its DP after an elastic shrink) leaves its missing
replicas' placement groups pending, which the autoscaler counts as demand; it also asks for the whole target
layout at once with ``ray.autoscaler.sdk.request_resources`` (one bundle per worker), so that the autoscaler
scales to it in one go rather than a node per pending group. The request is withdrawn when the job reaches
its target or ends.

Ray keeps one such request per cluster (each call replaces the last), so two growing runs on one cluster
replace each other's: the one that asked last is served, and the other's pending placement groups still
stand as demand.
"""
from __future__ import annotations


def ask(bundles: list[dict]) -> None:
    """Ask the autoscaler for room for `bundles` at once (replacing the cluster's standing request)."""
    from ray.autoscaler.sdk import request_resources
    request_resources(bundles=[{k: float(v) for k, v in b.items() if v} for b in bundles])


def withdraw() -> None:
    """Take the standing request back (an empty one)."""
    from ray.autoscaler.sdk import request_resources
    request_resources(bundles=[])


def standing() -> list[dict]:
    """The bundles the cluster's standing request asks for, as Ray keeps it (v1's KV entry, or v2's cluster
    resource constraints): [] when there is none."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    if is_autoscaler_v2():
        from ray._private.worker import global_worker
        from ray.autoscaler.v2.sdk import get_cluster_resource_state
        state = get_cluster_resource_state(global_worker.gcs_client)
        return [dict(r.request.resources_bundle) for c in state.cluster_resource_constraints
                for r in c.resource_requests for _ in range(r.count)]
    import json
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return list(json.loads(raw)) if raw else []
