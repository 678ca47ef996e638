"""Losing a whole node of a simulated cluster (fake GPUs, CPU compute) with a spare node present."""

import dataclasses
import json

import numpy as np
import pytest
import ray
from elastic_runs import shrink_and_grow_back
from faulty import HOLD_S, BlockedForGood, WaitsForMoved, WaitsForReplicas, WaitsForRoom, WaitsForSnapshotCopy
from helpers import (NEVER_S, assert_bitwise_equal, events, final_state, gpu_cluster, gpu_nodes, job, losses,
                     one_device_losses, parallel, ray_actors, recovery_job, run, wait_for)
from reference_runs import unbroken_run
from raytp.runtime.cluster import autoscaler

pytestmark = pytest.mark.slow  # a simulated cluster of up to 4 nodes, and two jobs per test


@pytest.fixture(scope="module")
def cluster(no_shared_ray):
    """A head without GPUs, shared by the module; each test sets its GPU nodes with `gpu_nodes`."""
    # Objects of more than 1 KB go to the node's object store, as a real model's shards do (by default
    # Ray keeps objects under 100 KB, all of this test model's snapshots, in the owner's own memory).
    with gpu_cluster(0, {"max_direct_call_object_size": 1024}) as (c, _):
        yield c


def test_removed_node_is_replaced_from_the_dp_replica(cluster, recovery_reference, tmp_path):
    nodes = gpu_nodes(cluster, 3)  # two used, one spare
    reference = recovery_reference(2, 2, gpus_per_worker=1.0)  # (test_recovery's too, in a whole run)
    by_id = {n.node_id: n for n in nodes}

    def remove_replica_1_node(run_name):
        node_id = ray_actors(f"raytp.{run_name}.rank2")[f"raytp.{run_name}.rank2"]["node_id"]
        cluster.remove_node(by_id[node_id])
        remove_replica_1_node.node_id = node_id

    run_dir = tmp_path / "run"
    run(recovery_job(2, 2, gpus_per_worker=1.0), run_dir, "nloss", faults=[(6, remove_replica_1_node)])
    assert_bitwise_equal(final_state(run_dir), reference)
    fails = events(run_dir, "failure")
    assert sorted(f["rank"] for f in fails) == [2, 3] and {f["node"] for f in fails} == {remove_replica_1_node.node_id}
    (rec,) = events(run_dir, "recovered")
    assert rec["source"] == "replica" and rec["lost_steps"] == 0
    placed = events(run_dir, "placed")[-1]["ranks"]
    assert placed[2]["node_id"] == placed[3]["node_id"] != remove_replica_1_node.node_id


def test_a_replica_beside_its_twin_moves_to_a_node_that_joins(cluster, recovery_reference, tmp_path):
    """TP=2 x DP=2 on one 4-GPU node: a loss of that node needs the checkpoint. A 2-GPU node joins while the
    job trains: replica 1 moves there at a step boundary (from its twin, nothing lost, bit for bit), and
    the job then survives the loss of either node."""
    gpu_nodes(cluster, 0)
    big = cluster.add_node(num_cpus=4, num_gpus=4)
    cluster.wait_for_nodes(timeout=NEVER_S)
    reference = recovery_reference(2, 2, gpus_per_worker=1.0)  # on the big node, if not run already
    ref_dir = recovery_reference.run_dir(2, 2)
    added = []

    def add_a_node(run_name):
        added.append(cluster.add_node(num_cpus=2, num_gpus=2))
        cluster.wait_for_nodes(timeout=NEVER_S)

    try:
        run_dir = tmp_path / "run"
        # the node's id is known only once it is added, after the worker class was shipped: a file tells it
        node_file = tmp_path / "node-id"
        WaitsForRoom.run, WaitsForRoom.node_file, WaitsForRoom.need = "move", str(node_file), {"GPU": 2.0, "CPU": 2.0}
        cfg = recovery_job(2, 2, gpus_per_worker=1.0, step_timeout_s=2 * HOLD_S)

        def add_and_tell(run_name):
            add_a_node(run_name)
            node_file.write_text(added[0].node_id)

        run(cfg, run_dir, "move", faults=[(2, add_and_tell)], worker_cls=WaitsForRoom)
        assert_bitwise_equal(final_state(run_dir), reference)
        (moved,) = events(run_dir, "moved")
        assert moved["ranks"] == [2, 3] and moved["from_node"] == big.node_id and moved["to_node"] == added[0].node_id
        assert moved["lost_steps"] == 0 and moved["stall_s"] > 0
        first, *_, last = events(run_dir, "survival")
        assert first["replicas"] == {big.node_id: False}  # (the snapshots' copy on the head covers it)
        assert last["replicas"] == last["nodes"] == {big.node_id: True, added[0].node_id: True}
        placed = events(run_dir, "placed")[-1]["ranks"]
        assert [p["node_id"] for p in placed] == [big.node_id] * 2 + [added[0].node_id] * 2
        assert [m["step"] for m in map(json.loads, open(run_dir / "metrics.jsonl"))] == \
            [m["step"] for m in map(json.loads, open(ref_dir / "metrics.jsonl"))]
        assert [(m["step"], m["loss"]) for m in map(json.loads, open(run_dir / "metrics.jsonl"))] == \
            [(m["step"], m["loss"]) for m in map(json.loads, open(ref_dir / "metrics.jsonl"))]
    finally:
        for node in [big, *added]:
            cluster.remove_node(node)


def test_elastic_job_shrinks_without_capacity_and_grows_back(cluster, tmp_path):
    """Two GPU nodes, both used by TP=1 x CP=2 x DP=2 (each replica a CP pair on one node): lose one with no
    spare -> DP 2 -> 1; add a node -> DP 2; a few steps at DP 2 later the job is stopped as `raytp stop` stops
    it (`steps` only keeps it alive until then). As the node goes, rank 0 (on the other) stays in its step, idle,
    past the abort: ended as blocked for good, it is replaced in its own bundle and its replica kept. (Dense
    shrinks at cp 1: the drained and zero 1 cases below.)"""
    marker = tmp_path / "block"
    BlockedForGood.rank_of, BlockedForGood.marker = 0, str(marker)
    cfg = parallel(job(1, 2, steps=400, gpus_per_worker=1.0, recovery={"replace_timeout_s": 3.0}), cp=2, min_dp=1)
    resized, metrics = shrink_and_grow_back(cluster, gpu_nodes(cluster, 2), cfg, tmp_path / "run", "elastic", 2,
                                            worker_cls=BlockedForGood, as_it_goes=marker.touch)
    assert [(e["old"]["dp"], e["new"]["dp"]) for e in resized] == [(2, 1), (1, 2)]
    assert {m["dp"] for m in metrics} == {1, 2}
    assert resized[0]["bytes"] > 0, resized[0]  # rank 0's state, from its CP twin to its replacement
    (blocked,) = events(tmp_path / "run", "still_blocked")
    assert blocked["ended"] == [0], blocked
    causes = sorted((e["rank"], e["cause"]) for e in events(tmp_path / "run", "failure"))
    assert causes == [(0, "stuck"), (2, "died"), (3, "died")], causes
    assert sorted(ray_actors("raytp.elastic.rank")) == []  # released at the end


def test_ranks_leave_a_node_that_ray_drains_before_its_deadline_and_lose_nothing(cluster, recovery_reference,
                                                                               tmp_path):
    """TP=2 x DP=1 (no DP twin) on one node, a spare node beside it: `ray drain-node` of the workers' node
    (preemption, 60 s deadline) -> the stage moves to the spare at a step boundary, the ranks handing over
    their own state: no failure, 0 steps lost, bit for bit an undisturbed run."""
    import time

    from ray.core.generated import autoscaler_pb2
    gpu_nodes(cluster, 2)
    reference = recovery_reference(2, 1, gpus_per_worker=1.0)
    drained = {}

    def drain_the_workers_node(run_name):
        node_id = ray_actors(f"raytp.{run_name}.rank0")[f"raytp.{run_name}.rank0"]["node_id"]
        drained.update(node=node_id, deadline=time.time() + 60)
        gcs = ray._raylet.GcsClient(address=cluster.address)
        accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                       "spot instance reclaimed", int(drained["deadline"] * 1000))
        assert accepted, why

    WaitsForMoved.run, WaitsForMoved.ranks, WaitsForMoved.at = "drain", (0, 1), 8
    run_dir = tmp_path / "run"
    run(recovery_job(2, 1, gpus_per_worker=1.0, step_timeout_s=2 * HOLD_S), run_dir, "drain",
        faults=[(3, drain_the_workers_node)], worker_cls=WaitsForMoved)
    assert_bitwise_equal(final_state(run_dir), reference)
    (draining,) = events(run_dir, "draining")
    assert draining["node"] == drained["node"] and draining["ranks"] == [0, 1] and draining["deadline"] > 0
    (moved,) = events(run_dir, "moved")
    assert moved["reason"] == "drain" and moved["from_node"] == drained["node"] != moved["to_node"]
    assert moved["lost_steps"] == 0 and moved["time"] < drained["deadline"]
    assert not events(run_dir, "failure") and not events(run_dir, "recovered")
    assert [m["step"] for m in map(json.loads, open(run_dir / "metrics.jsonl"))] == list(range(16))
    for node in list(cluster.worker_nodes):  # the autoscaler ends a drained node (at its deadline at the latest)
        if node.node_id == drained["node"]:
            cluster.remove_node(node)


def test_a_drained_node_with_no_room_elsewhere_is_left_by_a_live_shrink_losing_nothing(cluster, recovery_reference,
                                                                                        tmp_path):
    """TP=2 x DP=2 under zero 1 filling two 2-GPU nodes, parallel.min_dp 1: `ray drain-node` of replica 0's
    node, with no node that has room for its ranks -> the job drops replica 0 at a step boundary (its ranks hand
    their AdamW rows to the kept ones first) and goes on with replica 1 (renumbered 0) at DP=1: no failure,
    every step once, the loss curve that of an undisturbed DP=2 run."""
    import time

    from ray.core.generated import autoscaler_pb2
    gpu_nodes(cluster, 2)
    recovery_reference(2, 2, gpus_per_worker=1.0)
    reference = recovery_reference.run_dir(2, 2)
    drained = {}

    def drain_replica_0s_node(run_name):
        node_id = ray_actors(f"raytp.{run_name}.rank0")[f"raytp.{run_name}.rank0"]["node_id"]
        drained.update(node=node_id)
        gcs = ray._raylet.GcsClient(address=cluster.address)
        accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                       "spot instance reclaimed", int((time.time() + 60) * 1000))
        assert accepted, why

    WaitsForMoved.run, WaitsForMoved.ranks, WaitsForMoved.at = "dshrink", (), 15  # steps of 0.4 s from step 3
    base = recovery_job(2, 2, gpus_per_worker=1.0, step_timeout_s=2 * HOLD_S)
    run_dir = tmp_path / "run"
    run(dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, min_dp=1, zero=1)), run_dir, "dshrink",
        faults=[(3, drain_replica_0s_node)], worker_cls=WaitsForMoved)
    (draining,) = events(run_dir, "draining")
    assert draining["node"] == drained["node"] and draining["ranks"] == [0, 1]
    (resized,) = events(run_dir, "resized")
    assert (resized["old"]["dp"], resized["new"]["dp"]) == (2, 1) and resized["lost_steps"] == 0
    assert resized["bytes"] > 0  # the dropped replica's AdamW rows
    assert resized["reason"] == f"drained node {drained['node']}; kept replicas [1] of 2"
    assert not events(run_dir, "failure") and not events(run_dir, "recovered")
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(16)) and metrics[-1]["dp"] == 1
    np.testing.assert_allclose(losses(run_dir), losses(reference), rtol=0, atol=1e-4)
    placed = events(run_dir, "placed")[-1]["ranks"]
    assert drained["node"] not in {p["node_id"] for p in placed} and len(placed) == 2
    for node in list(cluster.worker_nodes):
        if node.node_id == drained["node"]:
            cluster.remove_node(node)


def test_a_job_grows_into_nodes_as_they_join_up_to_max_dp(cluster, tmp_path):
    """TP=2 at DP=1 with parallel.max_dp 3 on one 2-GPU node: it asks for two more replicas (pending placement
    groups, and the autoscaler for the whole target) and trains on; a node joins -> DP 2, another -> DP 3,
    live, nothing lost, the loss curve one device's (every layout trains alike)."""
    grow_job = job(2, 1, steps=16, gpus_per_worker=1.0)
    grow_job = dataclasses.replace(grow_job, train=dataclasses.replace(grow_job.train, batch_size=6),
                                   parallel=dataclasses.replace(grow_job.parallel, max_dp=3))
    gpu_nodes(cluster, 1)
    asked = []

    def add_a_node(run_name):
        asked.append(autoscaler.standing())  # the request stands while the job waits for room
        cluster.add_node(num_cpus=2, num_gpus=2)

    WaitsForReplicas.run, WaitsForReplicas.at = "grow", {1: 3, 2: 8}
    run_dir = tmp_path / "run"
    run(grow_job, run_dir, "grow", faults=[(2, add_a_node), (6, add_a_node)], worker_cls=WaitsForReplicas)
    resized = events(run_dir, "resized")
    assert [(e["old"]["dp"], e["new"]["dp"]) for e in resized] == [(1, 2), (2, 3)], resized
    assert {e["reason"] for e in resized} == {"capacity returned"} and not events(run_dir, "failure")
    worker = {"CPU": 1.0, "GPU": 1.0}
    assert asked[0] == [worker] * 6, asked  # the target layout: 3 replicas of 2 workers
    assert autoscaler.standing() == []  # withdrawn once grown
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(16)) and [m["dp"] for m in metrics][-1] == 3
    one = dataclasses.replace(grow_job, parallel=dataclasses.replace(grow_job.parallel, tp=1, max_dp=None))
    ours, theirs = np.array(losses(run_dir)), np.array(one_device_losses(one))
    assert (np.abs(ours - theirs) / theirs).max() < 1e-4, (ours, theirs)
    assert sorted(ray_actors("raytp.grow.rank")) == [] and not [
        g for g in ray.util.placement_group_table().values()
        if g.get("name", "").startswith("raytp.grow.") and g.get("state") != "REMOVED"]


# The job waits at step 4 for the copy (faulty.WaitsForSnapshotCopy); the node goes after step 6.
COPY_STEPS = 24


def copy_job(tp=2, dp=1, zero=0):
    cfg = job(tp, dp, steps=COPY_STEPS, checkpoint={"every": COPY_STEPS, "keep": 2},
              recovery={"snapshot_every": 1}, step_timeout_s=2 * HOLD_S, gpus_per_worker=1.0)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=zero))


def test_lost_node_of_a_dp1_job_restores_from_the_snapshot_copy_on_another_node(cluster, tmp_path):
    """TP=2 x DP=1: no DP replica anywhere, and the node that holds the snapshots goes. The copy the
    keeper pulled to the driver's node (the head, no GPUs) brings the job back, bitwise."""
    gpu_nodes(cluster, 2)  # one used, one to move to
    ref_dir = tmp_path / "ref"
    unbroken_run(copy_job(), ref_dir, "cref")  # forked ranks, no Ray (tests/reference_runs.py)
    head = ray.get_runtime_context().get_node_id()

    def remove_workers_node(run_name):
        node_id = ray_actors(f"raytp.{run_name}.rank0")[f"raytp.{run_name}.rank0"]["node_id"]
        wait_for(lambda: events(run_dir, "snapshot_copy"), "no snapshot copy was placed")  # holds a snapshot
        cluster.remove_node({n.node_id: n for n in cluster.list_all_nodes()}[node_id])
        remove_workers_node.node_id = node_id

    run_dir = tmp_path / "run"
    WaitsForSnapshotCopy.run, WaitsForSnapshotCopy.marker = "ncopy", str(tmp_path / "copy-awaited")
    run(copy_job(), run_dir, "ncopy", faults=[(6, remove_workers_node)], worker_cls=WaitsForSnapshotCopy)
    assert_bitwise_equal(final_state(run_dir, COPY_STEPS), final_state(ref_dir, COPY_STEPS))
    assert events(run_dir, "snapshot_copy")[0]["node"] == head
    assert sorted(f["rank"] for f in events(run_dir, "failure")) == [0, 1]
    (rec,) = events(run_dir, "recovered")
    assert rec["source"] == "snapshot copy", rec
    assert rec["lost_steps"] <= 3  # the copy is refreshed as its pulls finish: it may trail by a step or two
    placed = events(run_dir, "placed")[-1]["ranks"]
    assert placed[0]["node_id"] == placed[1]["node_id"] != remove_workers_node.node_id


@pytest.fixture(scope="module")
def zero_reference(cluster, tmp_path_factory):
    """The uninterrupted TP=1 x DP=2 copy_job at zero 0 (run once for the zero-1 tests of this module)."""
    gpu_nodes(cluster, 2)
    ref_dir = tmp_path_factory.mktemp("zref")
    unbroken_run(copy_job(1, 2), ref_dir, "zref")  # forked ranks, no Ray
    return ref_dir


def test_removed_node_under_zero1_restores_from_the_snapshot_copy(cluster, zero_reference, tmp_path):
    """TP=1 x DP=2 under parallel.zero: 1, the replicas on nodes of their own: replica 1's node goes, and with
    it the only copy of its rank's AdamW rows and that rank's snapshot. The keeper's off-node copy of every
    rank's part brings the job back, bit for bit where the same job at zero 0 ends uninterrupted."""
    ref_dir = zero_reference
    gpu_nodes(cluster, 3)  # two used, one to move to

    def remove_rank_1_node(run_name):
        node_id = ray_actors(f"raytp.{run_name}.rank1")[f"raytp.{run_name}.rank1"]["node_id"]
        wait_for(lambda: events(run_dir, "snapshot_copy"), "no snapshot copy was placed")
        cluster.remove_node({n.node_id: n for n in cluster.list_all_nodes()}[node_id])

    run_dir = tmp_path / "run"
    WaitsForSnapshotCopy.run, WaitsForSnapshotCopy.marker = "zloss", str(tmp_path / "copy-awaited")
    run(copy_job(1, 2, zero=1), run_dir, "zloss", faults=[(6, remove_rank_1_node)], worker_cls=WaitsForSnapshotCopy)
    assert_bitwise_equal(final_state(run_dir, COPY_STEPS), final_state(ref_dir, COPY_STEPS))
    assert [f["rank"] for f in events(run_dir, "failure")] == [1]
    (rec,) = events(run_dir, "recovered")
    assert rec["source"] == "snapshot copy" and rec["lost_steps"] <= 3, rec


def test_elastic_shrink_under_zero1_recuts_the_lost_rows_from_the_snapshot(cluster, zero_reference, tmp_path):
    """TP=1 x DP=2 under zero 1 with parallel.min_dp 1 and no spare capacity: replica 1's node goes, with the
    only live copy of its rank's AdamW rows. The job shrinks to DP=1: the kept rank takes every rank's rows
    of the newest snapshot (whose parts the keeper also holds off both nodes), replays from it, and ends
    where the uninterrupted job at DP=2 does, to within the reduction order (without the lost rows the
    weights end 3e-2 away, tried)."""
    alive = {n.node_id: n for n in gpu_nodes(cluster, 2)}  # both filled: nothing to replace with

    def remove_rank_1_node(run_name):
        node_id = ray_actors(f"raytp.{run_name}.rank1")[f"raytp.{run_name}.rank1"]["node_id"]
        wait_for(lambda: events(run_dir, "snapshot_copy"), "no snapshot copy was placed")
        cluster.remove_node(alive[node_id])

    cfg = copy_job(1, 2, zero=1)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, min_dp=1),
                              recovery=dataclasses.replace(cfg.recovery, replace_timeout_s=3.0),
                              runtime=dataclasses.replace(cfg.runtime, gpus_per_worker=2.0))  # a node each
    run_dir = tmp_path / "run"
    WaitsForSnapshotCopy.run, WaitsForSnapshotCopy.marker = "zshrink", str(tmp_path / "copy-awaited")
    run(cfg, run_dir, "zshrink", faults=[(6, remove_rank_1_node)], worker_cls=WaitsForSnapshotCopy)
    (resized,) = events(run_dir, "resized")
    assert (resized["old"]["dp"], resized["new"]["dp"]) == (2, 1) and resized["reason"].startswith("lost capacity")
    (rec,) = events(run_dir, "recovered")
    assert rec["source"].startswith("shrink to DP=1 from the snapshot"), rec
    ours, ref = final_state(run_dir, COPY_STEPS), final_state(zero_reference, COPY_STEPS)
    for n in ref["model"]:
        diff = float((ours["model"][n] - ref["model"][n]).abs().max())
        assert diff < 1e-5, f"{n} left the uninterrupted run by {diff:.2e}"
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(COPY_STEPS)) and metrics[-1]["dp"] == 1
