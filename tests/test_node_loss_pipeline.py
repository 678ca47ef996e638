"""Losing a whole node of a simulated cluster (fake GPUs, CPU compute): a pipeline job placed so that no node
holds both copies of a stage survives the loss of any one node (test_node_loss.py has the other node losses;
the two files run beside each other)."""

import pytest
from helpers import final_state, gpu_cluster, gpu_nodes, lose_a_named_node, parallel, recovery_job

pytestmark = pytest.mark.slow  # a simulated cluster of three nodes, and four jobs


@pytest.fixture(scope="module")
def cluster(no_shared_ray):
    """A head without GPUs, shared by the module; each test sets its GPU nodes with `gpu_nodes`."""
    with gpu_cluster(0, {"max_direct_call_object_size": 1024}) as (c, _):
        yield c


@pytest.fixture(scope="module")
def pp2_dp2_reference(cluster, shared_run):
    """(test_random_faults' and test_step_records' PP=2 x DP=2 reference: run here if not run already)"""
    gpu_nodes(cluster, 3)
    return final_state(shared_run("ref-pp2-dp2", pp_job()))


def pp_job():
    return parallel(recovery_job(1, 2, gpus_per_worker=1.0, model={"n_layer": 3}), pp=2)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_each_node_of_a_pipeline_job_whose_loss_the_start_line_says_it_survives_loses_nothing(
        cluster, pp2_dp2_reference, which, tmp_path):
    """PP=2 x DP=2 (one placement group per stage and replica) on three GPU nodes: placed by rule so that
    no node holds both copies of a stage, which the start line and the `survival` event say; each node in
    turn (the `which`-th the event names) is removed, and its ranks come back on the capacity left,
    restored bit for bit from the other copies."""
    # Survives any one node's loss: on three nodes, or on two where each holds one copy of each stage (both
    # placements happen, by the order the groups land in).
    lose_a_named_node(cluster, gpu_nodes(cluster, 3), pp_job(), tmp_path / "run", f"ppnloss{which}", which,
                      pp2_dp2_reference)


