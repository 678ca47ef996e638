"""Placement on a simulated multi-node cluster with fake GPUs (computing on CPU with gloo)."""
import io
import json

import pytest
from ray.util.placement_group import placement_group_table

from helpers import SMALL_MOE, gpu_cluster, job, parallel, ray_actors
from raytp.runtime.driver.driver import Driver
from raytp.runtime.cluster.placement import PlacementError


pytestmark = pytest.mark.slow  # a simulated cluster of two GPU nodes (decisions: test_policy)


@pytest.fixture(scope="module")
def two_gpu_nodes(no_shared_ray):
    with gpu_cluster(2) as cluster_and_nodes:
        yield cluster_and_nodes


def test_tp_groups_share_a_node_and_replicas_spread(two_gpu_nodes, tmp_path):
    cluster, nodes = two_gpu_nodes
    d = Driver(job(2, 2, steps=2, gpus_per_worker=1.0), tmp_path, "place", out=io.StringIO())
    try:
        d.start()
        actors = ray_actors("raytp.place.rank")  # where Ray says each rank runs
        node = {int(name.rsplit("rank", 1)[1]): a["node_id"] for name, a in actors.items()}
        gpu_nodes = {n.node_id for n in nodes}
        assert set(node.values()) <= gpu_nodes, "workers must sit on the GPU nodes"
        assert node[0] == node[1] and node[2] == node[3], f"a TP group spans nodes: {node}"
        assert node[0] != node[2], f"both DP replicas on one node: {node}"
        d.train_loop(0.0)
        assert d.step == 2
    finally:
        d.release()
        d.log.close()


def test_layout_that_cannot_fit_fails_clearly_and_leaves_nothing(two_gpu_nodes, tmp_path):
    d = Driver(job(8, 1, model={"n_head": 8}, gpus_per_worker=1.0, placement_timeout_s=3.0), tmp_path, "toobig", out=io.StringIO())
    with pytest.raises(PlacementError) as err:
        d.run_to_end()
    msg = str(err.value)
    assert "TP=8 x DP=1 needs 1 node slot(s) of {CPU: 8, GPU: 8}" in msg and "GPU: 2" in msg
    assert not ray_actors("raytp.toobig.")
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values() if pg["name"].startswith("raytp.toobig."))
    events = [json.loads(line)["kind"] for line in open(tmp_path / "events.jsonl")]
    assert events == ["started", "failed"]


def test_prepare_spreads_over_the_nodes_and_writes_what_one_process_writes(two_gpu_nodes, tmp_path):
    """raytp prepare on the simulated cluster: its shards are encoded on several nodes (Ray Data spreads the
    tasks), and the dataset's bytes are those of the in-process path's."""
    import sysconfig
    from pathlib import Path
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from raytp.data.prepare import prepare_local
    from raytp.data.prepare.driver import run
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [d for name in ("abc.py", "bisect.py", "heapq.py", "textwrap.py")
            for d in (stdlib / name).read_text().split("\n\n") if d.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    done = run([str(tmp_path / "corpus.jsonl")], str(tmp_path / "tokenizer.json"), str(tmp_path / "cluster"),
               shard_tokens=500, progress=False)
    assert len(done.manifest.shards) >= 8
    assert len(done.node_tokens) >= 2, done.node_tokens  # more than one node encoded
    assert sum(done.node_tokens.values()) == done.manifest.tokens
    prepare_local([tmp_path / "corpus.jsonl"], str(tmp_path / "tokenizer.json"), str(tmp_path / "local"),
                  shard_tokens=500)
    for f in sorted((tmp_path / "local").glob("shard-*")):
        assert f.read_bytes() == (tmp_path / "cluster" / f.name).read_bytes(), f.name


def test_twins_misplaced_on_two_full_nodes_are_spread_again(two_gpu_nodes):
    """DP=4 x EP=2 on two 2-GPU nodes, as Ray once placed it: replicas 0 and 2 (experts 0-1) on one node, 1 and 3
    (experts 2-3) on the other, either node's loss taking an expert's every copy. Neither node has room for a
    group to move into until another leaves: the misplaced two are let go and asked for again together, and
    each node ends with one copy of each expert."""
    from ray.util.placement_group import remove_placement_group

    from raytp.runtime.cluster.placement import _group, respread
    from raytp.runtime.spread import copy_key
    _, nodes = two_gpu_nodes
    a, b = (n.node_id for n in nodes)
    cfg = parallel(job(1, 4, gpus_per_worker=1.0, model=SMALL_MOE), ep=2)
    landed, aims = {0: a, 2: a, 1: b, 3: b}, {0: a, 1: a, 2: b, 3: b}
    pgs = {d: _group(cfg, "twins", 1, d, 0, landed[d]) for d in range(4)}
    try:
        for pg in pgs.values():
            pg.wait(60)
        where = {d: next(iter(placement_group_table(pg)["bundles_to_node_id"].values())) for d, pg in pgs.items()}
        assert where == landed, "the test's misplacement did not take"
        pgs = respread(cfg, "twins", 1, pgs, {pg.id.hex(): aims[d] for d, pg in pgs.items()})
        where = {d: next(iter(placement_group_table(pg)["bundles_to_node_id"].values())) for d, pg in pgs.items()}
        by_node = {n: sorted(copy_key(cfg.layout, d, 0) for d in where if where[d] == n) for n in (a, b)}
        assert by_node[a] == by_node[b] and len(set(by_node[a])) == 2, (where, by_node)
    finally:
        for pg in pgs.values():
            remove_placement_group(pg)
