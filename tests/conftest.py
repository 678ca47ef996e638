"""Shared fixtures. Ray clusters made here bind to loopback and are shut down in teardown."""
import contextlib
import os

# Read by Ray at import: makes every node the tests start use 127.0.0.1 (name notwithstanding).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    """A fresh local Ray instance with 4 CPUs (enough for TP=2 x DP=2), shut down afterwards."""
    import ray
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="raytp",
             log_to_driver=False)
    yield ray
    ray.shutdown()


def ray_actors(name_prefix: str, alive_only: bool = True) -> dict[str, dict]:
    """Actors as Ray's GCS records them, by name: {"name": {"node_id", "pid", "state"}}."""
    from ray._private import state
    out = {}
    for a in state.actors().values():
        if a.get("Name", "").startswith(name_prefix) and (not alive_only or a["State"] == "ALIVE"):
            out[a["Name"]] = {"node_id": a["Address"]["NodeID"], "pid": a["Pid"], "state": a["State"]}
    return out


@contextlib.contextmanager
def gpu_cluster(gpu_nodes: int, system_config: dict | None = None):
    """A simulated cluster: a head with no GPUs (the driver's node) and `gpu_nodes` nodes of 2 CPUs
    and 2 fake GPUs each, on loopback; connected, and shut down afterwards. Yields (cluster, nodes)."""
    import ray
    from ray.cluster_utils import Cluster
    head = {"num_cpus": 1, "num_gpus": 0}
    if system_config:
        head["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head)
    nodes = [cluster.add_node(num_cpus=2, num_gpus=2) for _ in range(gpu_nodes)]
    ray.init(address=cluster.address, namespace="raytp", log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
