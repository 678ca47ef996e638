"""Shared fixtures (shared helpers are in helpers.py). Ray clusters made here bind to loopback and are
shut down in teardown."""
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
