"""Losing a whole node of a simulated cluster (fake GPUs, CPU compute) under expert parallelism: at TP=1 x
DP=4 x EP=2 replicas 0 and 2 hold experts 0-1, replicas 1 and 3 experts 2-3; placement aims the replicas
holding the same experts at different nodes (raytp.runtime.spread.copy_key): on two nodes of two GPUs, each
holds one copy of each expert (aimed by stage alone, one node would hold replicas 0 and 2, and its loss would
take experts 0-1 with it). The start line says the job survives any one node's loss; each node is lost in
turn (a fresh node joins for its ranks) and the job heals from the expert-DP twins, bit for bit, with nothing
lost."""

import pytest
from elastic_runs import shrink_and_grow_back
from helpers import (SMALL_MOE, events, final_state, gpu_cluster, gpu_nodes, job, lose_a_named_node, parallel,
                     recovery_job)

pytestmark = pytest.mark.slow  # a simulated cluster of two nodes (and one joining), and four jobs



@pytest.fixture(scope="module")
def cluster(no_shared_ray):
    """A head without GPUs, shared by the module; each test sets its GPU nodes with `gpu_nodes`."""
    with gpu_cluster(0, {"max_direct_call_object_size": 1024}) as (c, _):
        yield c


def ep_job():
    return parallel(recovery_job(1, 4, gpus_per_worker=1.0, model=SMALL_MOE), ep=2)


@pytest.fixture(scope="module")
def reference(cluster, shared_run):
    """(test_random_faults' and test_moe_ep_runtime's TP=1 x DP=4 x EP=2 reference: run here if not run already)"""
    gpu_nodes(cluster, 2)
    return final_state(shared_run("ref-ep2-dp4", ep_job()))


@pytest.mark.parametrize("which", [0, 1])
def test_each_node_of_an_expert_parallel_job_is_lost_without_losing_anything(cluster, reference, which, tmp_path):
    lose_a_named_node(cluster, gpu_nodes(cluster, 2), ep_job(), tmp_path / "run", f"epnloss{which}", which,
                      reference, joins=True)


def test_an_elastic_expert_parallel_job_shrinks_to_a_layout_its_experts_fold_over_and_grows_back(cluster, tmp_path):
    """TP=1 x DP=4 x EP=2 with parallel.min_dp 2 on two 2-GPU nodes, each holding one copy of each expert: one
    node lost with no room for its ranks -> DP=2, the replicas left holding both experts' places (no expert
    from a snapshot); a node joins -> back to DP=4 (DP=3 is no layout: ep must divide it); a few steps at DP=4
    later the job is stopped as `raytp stop` stops it (`steps` only keeps it alive until then)."""
    cfg = parallel(job(1, 4, steps=400, gpus_per_worker=1.0, model=SMALL_MOE, recovery={"replace_timeout_s": 3.0}),
                   ep=2, min_dp=2)
    run_dir = tmp_path / "run"
    resized, metrics = shrink_and_grow_back(cluster, gpu_nodes(cluster, 2), cfg, run_dir, "epelastic", 1)
    assert [(e["old"]["dp"], e["new"]["dp"]) for e in resized] == [(4, 2), (2, 4)]
    assert all(e["new"]["ep"] == 2 for e in resized) and {m["dp"] for m in metrics} == {2, 4}
    (healed,) = events(run_dir, "recovered")
    assert healed["source"] == "shrink to DP=2", healed  # the experts of both places from live replicas
