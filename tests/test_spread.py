"""Where the copies of a shard sit (raytp.runtime.spread): pure, no Ray."""
from raytp.parallel.layout import Layout
from raytp.runtime import spread
from raytp.runtime.spread import Move

GPU2 = {"GPU": 2.0, "CPU": 2.0}


def keys(layout):
    return [spread.copy_key(layout, d, s) for d in range(layout.dp) for s in range(layout.pp)]


def test_placement_aims_keep_a_stages_replicas_on_different_nodes():
    # Enough nodes: one (replica, stage) group per node, in order.
    assert spread.spread_targets(4, keys(Layout(1, pp=2, dp=2))) == [0, 1, 2, 3]
    # 3 nodes for 2 replicas x 2 stages: the fourth group shares a node, but not with the other replica's
    # copy of its stage, so losing any one node leaves every stage a replica.
    aims = spread.spread_targets(3, keys(Layout(1, pp=2, dp=2)))
    assert aims[:3] == [0, 1, 2] and aims[3] != aims[1]
    for node in range(3):
        lost = {k % 2 for k, n in enumerate(aims) if n == node}  # stages on that node
        assert all(any(aims[r * 2 + s] != node for r in range(2)) for s in lost)
    # Fewer nodes than replicas of a stage: the least loaded.
    assert spread.spread_targets(2, keys(Layout(1, dp=3))) == [0, 1, 0]
    assert spread.spread_targets(0, keys(Layout(1, dp=2))) == [None, None]


def test_replicas_holding_the_same_experts_aim_at_different_nodes():
    """DP=4 x EP=2 on two nodes: replicas 0 and 2 hold experts 0-1, 1 and 3 experts 2-3; stage-only aims would
    put 0 and 2 together (a node whose loss takes experts 0-1 with it). By copy: each node one of each."""
    ep = Layout(1, dp=4, ep=2)
    assert keys(ep) == [(0, (0,)), (0, (1,)), (0, (0,)), (0, (1,))]
    aims = spread.spread_targets(2, keys(ep))
    assert aims == [0, 1, 1, 0]
    assert spread.node_losses(ep, ["a" if n == 0 else "b" for n in aims]) == {"a": True, "b": True}
    assert spread.node_losses(ep, ["a", "b", "a", "b"]) == {"a": False, "b": False}  # the stage-only aims
    assert spread.copy_key(Layout(2, dp=2, ep=2, etp=1), 0, 0) == (0, (0, 1))  # EP over a replica's TP ranks


def test_only_a_group_off_its_target_beside_a_copy_of_its_stage_is_asked_for_again():
    """(copy key, landed on, aimed at) per group: two copies of stage 1 on node a, one of them aimed at c."""
    landed = [((0,), "a", "a"), ((1,), "a", "b"), ((0,), "b", "b"), ((1,), "a", "a"), ((1,), "c", "c")]
    assert spread.off_their_twins(landed) == [1]
    assert spread.off_their_twins([((0,), "a", "a"), ((1,), "a", "b")]) == []  # two stages may share a node
    assert spread.off_their_twins([((0,), "a", None), ((0,), "a", None)]) == []  # aimed nowhere: one node only


def test_node_losses_says_which_nodes_a_layout_survives():
    pp2dp2 = Layout(1, pp=2, dp=2, zero=0)  # ranks 0, 1: replica 0's stages; 2, 3: replica 1's
    apart = ["a", "b", "c", "a"]  # stage 0 on a and c, stage 1 on b and a: every stage has a copy elsewhere
    assert spread.node_losses(pp2dp2, apart) == {"a": True, "b": True, "c": True}
    twins = ["a", "b", "a", "b"]  # the same stage's two copies on one node
    assert spread.node_losses(pp2dp2, twins) == {"a": False, "b": False}
    assert spread.node_losses(pp2dp2, twins, copy_node="c") == {"a": True, "b": True}  # the snapshots' copy
    assert spread.node_losses(pp2dp2, twins, copy_node="a") == {"a": False, "b": True}
    zero = Layout(1, pp=1, dp=2, zero=1)  # the AdamW rows have no replica under zero 1
    assert spread.node_losses(zero, ["a", "b"]) == {"a": False, "b": False}
    line = spread.survival_line({"a": True, "b": False}, {"b": "10.0.0.2"})
    assert line == "a loss of node 10.0.0.2 needs the checkpoint (no copy of its shards on another node)"
    assert spread.survival_line({"a": True}, {}) == "survives the loss of any 1 node without a checkpoint"
    line = spread.survival_line({"a": True}, {"a": "10.0.0.1"}, by_replica={"a": False})
    assert line.startswith("survives the loss of any 1 node without a checkpoint (of node 10.0.0.1 from the snapshots'")
    assert "once it holds one" in line  # not before: a node lost while its keeper starts takes its shards


def test_a_copy_beside_its_twin_moves_to_a_node_with_room():
    tp2dp2 = Layout(2, dp=2)  # replica 0: ranks 0, 1; replica 1: ranks 2, 3
    both = ["a", "a", "a", "a"]
    # replica 1 (not replica 0, which makes the snapshots) goes to the node with room
    assert spread.move_off_twin(tp2dp2, both, {"a": {}, "b": GPU2}, {"GPU": 2.0}) == Move(1, 0, "b")
    assert spread.move_off_twin(tp2dp2, both, {"a": {}, "b": {"GPU": 1.0}}, {"GPU": 2.0}) is None  # no room
    assert spread.move_off_twin(tp2dp2, ["a", "a", "b", "b"], {"c": GPU2}, {"GPU": 2.0}) is None  # apart already
    assert spread.move_off_twin(tp2dp2, both[:2], {"b": GPU2}, {}) is None  # not placed yet
    # the least loaded node with room
    free = {"a": {}, "b": GPU2, "c": GPU2}
    assert spread.move_off_twin(tp2dp2, both, free, {"GPU": 2.0}).node == "b"
    assert spread.move_off_twin(tp2dp2, ["a", "a", "a", "a", "c"][:4], free, {"GPU": 2.0}).node == "b"


def test_a_stage_moves_only_where_the_losses_needing_a_checkpoint_go_down():
    pp2dp2 = Layout(1, pp=2, dp=2, zero=0)  # ranks 0, 1: replica 0's stages; 2, 3: replica 1's
    twins = ["a", "b", "a", "b"]  # both copies of stage 0 on a, of stage 1 on b
    move = spread.move_off_twin(pp2dp2, twins, {"c": {"CPU": 1.0}}, {"CPU": 1.0})
    assert move is not None and move.dp == 1 and move.node == "c"
    moved = list(twins)
    moved[pp2dp2.tp_group(move.dp, move.stage)[0]] = "c"
    assert sum(not ok for ok in spread.node_losses(pp2dp2, moved).values()) == 1  # one of two nodes fixed
    assert spread.move_off_twin(pp2dp2, twins, {"a": {"CPU": 1.0}}, {"CPU": 1.0}).stage == 1  # b's twin to a
    assert spread.move_off_twin(pp2dp2, ["a", "b", "c", "d"], {"e": {"CPU": 1.0}}, {"CPU": 1.0}) is None
    assert spread.could_move(pp2dp2, twins)
    assert not spread.could_move(pp2dp2, ["a", "b", "c", "d"])
    assert not spread.could_move(Layout(1, dp=2, zero=1), ["a", "a"])  # zero 1: no rank's bytes held twice


def test_a_stage_on_a_drained_node_moves_to_a_node_with_room_away_from_its_twin():
    tp2dp2 = Layout(2, dp=2)  # replica 0: ranks 0, 1 on a; replica 1: ranks 2, 3 on b
    nodes = ["a", "a", "b", "b"]
    free = {"a": {}, "b": {}, "c": GPU2, "d": GPU2}
    assert spread.move_off_drained(tp2dp2, nodes, {"b"}, free, {"GPU": 2.0}) == Move(1, 0, "c", drain=True)
    assert spread.move_off_drained(tp2dp2, nodes, set(), free, {"GPU": 2.0}) is None  # nothing drained
    assert spread.move_off_drained(tp2dp2, nodes, {"e"}, free, {"GPU": 2.0}) is None  # not one of ours
    assert spread.move_off_drained(tp2dp2, nodes, {"b"}, {"c": {"GPU": 1.0}}, {"GPU": 2.0}) is None  # no room
    # never onto another drained node; beside its twin only when nothing else has room
    assert spread.move_off_drained(tp2dp2, nodes, {"b", "c"}, free, {"GPU": 2.0}).node == "d"
    assert spread.move_off_drained(tp2dp2, nodes, {"b"}, {"a": GPU2}, {"GPU": 2.0}) == Move(1, 0, "a", drain=True)
    assert spread.move_off_drained(tp2dp2, nodes, {"b"}, {"a": GPU2, "d": GPU2}, {"GPU": 2.0}).node == "d"
    # both replicas on the drained node: the first group first; a DP=1 job moves too (no twin needed)
    assert spread.move_off_drained(tp2dp2, ["a"] * 4, {"a"}, free, {"GPU": 2.0}) == Move(0, 0, "c", drain=True)
    assert spread.move_off_drained(Layout(2), ["a", "a"], {"a"}, free, {"GPU": 2.0}) == Move(0, 0, "c", drain=True)
    assert spread.move_off_drained(tp2dp2, nodes[:3], {"b"}, free, {"GPU": 2.0}) is None  # not placed yet


def _move_by_trying_each(layout, nodes, free, need):
    """move_off_twin's choice worked out the long way: every group to every node with room, node_losses each."""
    def needing(ns):
        return sum(not ok for ok in spread.node_losses(layout, ns).values())
    bad, load, best = needing(nodes), {n: nodes.count(n) for n in free}, None
    for d in reversed(range(layout.dp)):
        for s in range(layout.pp):
            ranks = layout.tp_group(d, s)
            if len({nodes[r] for r in ranks}) != 1:
                continue
            for node in sorted(free, key=lambda n: (load[n], n)):
                if node == nodes[ranks[0]] or not all(free[node].get(k, 0.0) >= v for k, v in need.items()):
                    continue
                after = needing([node if r in ranks else n for r, n in enumerate(nodes)])
                if bad and after < bad and (best is None or after < best[0]):
                    best = (after, Move(d, s, node))
    return best[1] if best else None


def test_the_move_off_a_twin_is_the_one_trying_every_group_finds():
    """move_off_twin counts a move of groups holding the same bytes between the same nodes once; its choice is
    the one trying every group on every node gives, on random placements of dense and expert layouts."""
    import random
    rng = random.Random(3)
    layouts = [Layout(2, dp=4), Layout(2, pp=2, dp=3), Layout(1, dp=4, ep=2), Layout(2, dp=4, ep=2, etp=1)]
    for _ in range(60):
        layout = rng.choice(layouts)
        names = [f"n{i}" for i in range(rng.randint(2, 5))]
        nodes = [None] * layout.world_size
        for d in range(layout.dp):
            for s in range(layout.pp):
                node = rng.choice(names)
                for r in layout.tp_group(d, s):
                    nodes[r] = node
        free = {n: {"CPU": float(rng.choice([0, 2, 4]))} for n in names}
        need = {"CPU": float(layout.tp)}
        assert spread.move_off_twin(layout, nodes, free, need) == _move_by_trying_each(layout, nodes, free, need)
