"""A TP resize on a simulated multi-node cluster (fake GPUs, CPU compute): a TP grow keeps the staying
workers and adds bundles on their node; where that node is full it restarts the job on one that fits."""
import io

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from helpers import FIXED, gpu_cluster, job, ray_actors
from raytp.runtime.driver.driver import Driver


def pids_and_nodes(run):
    return {n: (a["pid"], a["node_id"]) for n, a in ray_actors(f"raytp.{run}.rank").items()}


@ray.remote(num_gpus=2, num_cpus=0)
class Hog:
    def ping(self):
        return True


@pytest.mark.slow  # a simulated cluster, three resizes, a restart on another node
def test_tp_grow_stays_on_the_replicas_node_or_restarts_where_it_fits(no_shared_ray, tmp_path):
    with gpu_cluster(0) as (cluster, _):
        node_a = cluster.add_node(num_cpus=4, num_gpus=4)
        cluster.wait_for_nodes()
        out = io.StringIO()
        d = Driver(job(2, 1, steps=8, gpus_per_worker=1.0), tmp_path / "run", "nodes", out=out)
        try:
            d.start()
            d.train_loop(until=2)
            before, logits = pids_and_nodes("nodes"), d.logits(FIXED)
            assert {node for _, node in before.values()} == {node_a.node_id}

            assert d.resize(tp=4, dp=1).ok  # two more bundles on node A: ranks 0, 1 keep their processes
            grown = pids_and_nodes("nodes")
            assert sorted(grown) == [f"raytp.nodes.rank{r}" for r in range(4)]
            assert {n: grown[n] for n in before} == before
            assert {node for _, node in grown.values()} == {node_a.node_id}
            assert float((d.logits(FIXED) - logits).abs().max()) < 1e-5
            d.train_loop(until=4)

            assert d.resize(tp=2, dp=1).ok  # the extension group is released
            assert {n: p for n, p in pids_and_nodes("nodes").items()} == {n: grown[n] for n in before}
            groups = ray.util.placement_group_table().values()
            assert not [g for g in groups if ".ext" in g["name"] and g["state"] != "REMOVED"]
            d.train_loop(until=6)

            # Node A's other two GPUs taken, a node B with room: the grow restarts every worker on B.
            hog = Hog.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_a.node_id, soft=False)).remote()
            ray.get(hog.ping.remote())
            node_b = cluster.add_node(num_cpus=4, num_gpus=4)
            cluster.wait_for_nodes()
            kept = pids_and_nodes("nodes")
            logits = d.logits(FIXED)
            assert d.resize(tp=4, dp=1).ok
            assert "restarting every worker" in out.getvalue()
            moved = pids_and_nodes("nodes")
            assert {node for _, node in moved.values()} == {node_b.node_id}
            assert not {p for p, _ in moved.values()} & {p for p, _ in kept.values()}
            assert float((d.logits(FIXED) - logits).abs().max()) < 1e-5
            d.train_loop()
            assert d.step == 8
        finally:
            d.release()
            d.log.close()
