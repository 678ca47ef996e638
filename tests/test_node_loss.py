"""Losing a whole node of a simulated cluster (fake GPUs, CPU compute) with a spare node present."""

import pytest
import ray
from ray.cluster_utils import Cluster

from conftest import ray_actors
from test_recovery import STEPS, assert_bitwise_equal, events, final_state, recovery_job, run


@pytest.fixture(scope="module")
def three_gpu_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=2, num_gpus=2) for _ in range(3)]  # two used, one spare
    ray.init(address=cluster.address, namespace="raytp", log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


def test_removed_node_is_replaced_from_the_dp_replica(three_gpu_nodes, tmp_path):
    cluster, nodes = three_gpu_nodes
    ref_dir = tmp_path / "ref"
    run(recovery_job(2, 2, gpus_per_worker=1.0), ref_dir, "nref")
    by_id = {n.node_id: n for n in nodes}

    def remove_replica_1_node(run_name):
        node_id = ray_actors(f"raytp.{run_name}.rank2")[f"raytp.{run_name}.rank2"]["node_id"]
        cluster.remove_node(by_id[node_id])
        remove_replica_1_node.node_id = node_id

    run_dir = tmp_path / "run"
    run(recovery_job(2, 2, gpus_per_worker=1.0), run_dir, "nloss", faults=[(6, remove_replica_1_node)])
    assert_bitwise_equal(final_state(run_dir), final_state(ref_dir))
    fails = events(run_dir, "failure")
    assert sorted(f["rank"] for f in fails) == [2, 3] and {f["node"] for f in fails} == {remove_replica_1_node.node_id}
    (rec,) = events(run_dir, "recovered")
    assert rec["source"] == "replica" and rec["lost_steps"] == 0
    placed = events(run_dir, "placed")[-1]["ranks"]
    assert placed[2]["node_id"] == placed[3]["node_id"] != remove_replica_1_node.node_id
