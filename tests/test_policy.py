"""The runtime's decisions, as pure functions: no Ray, no processes, microseconds each."""
import pytest

from helpers import job
from raytp.config import ConfigError
from raytp.parallel.layout import Layout
from raytp.runtime import policy
from raytp.runtime.elastic import changes, rank_plans

TP2_DP2 = Layout(2, dp=2)


# -- failures -----------------------------------------------------------------------------------
def test_nobody_lost_is_an_error_of_the_job_and_too_many_losses_give_up():
    assert policy.on_failure({}, 0, 3) == policy.JOB_ERROR
    assert policy.on_failure({1: "died"}, 0, 3) == policy.RECOVER
    assert policy.on_failure({1: "died", 2: "hung"}, 2, 3) == policy.GIVE_UP  # 4 losses > 3
    assert policy.on_failure({1: "died"}, 0, 0) == policy.GIVE_UP


def test_restore_tries_the_live_holders_then_each_copy_of_their_step_then_everyone_rolls_back():
    # rank 1 lost; survivors all at step 7: the live holders first (the planner says whether a survivor holds
    # every lost byte: tests/test_move_plan.py), then the snapshot of step 7 for what they lack
    order = policy.restore_order({0: 7, 2: 7, 3: 7}, [1], [("snapshot", 7), ("snapshot copy", 6)], 4)
    assert [(w.source, w.step, w.alive, w.targets) for w in order] == [
        ("replica", 7, (0, 2, 3), (1,)), ("snapshot", 7, (0, 2, 3), (1,)),
        ("snapshot", 7, (), (0, 1, 2, 3)), ("snapshot copy", 6, (), (0, 1, 2, 3))]


def test_survivors_that_disagree_on_the_step_all_roll_back():
    order = policy.restore_order({0: 7, 2: 8, 3: 8}, [1], [("snapshot", 7)], 4)
    assert [(w.source, w.alive, w.targets) for w in order] == [("snapshot", (), (0, 1, 2, 3))]
    # survivors ahead of every copy: only a roll back, the snapshot first, then its copy
    order = policy.restore_order({0: 9, 1: 9, 3: 9}, [2], [("snapshot", 8), ("snapshot copy", 6)], 4)
    assert [(w.source, w.step, w.targets) for w in order][1:] == [
        ("snapshot", 8, (0, 1, 2, 3)), ("snapshot copy", 6, (0, 1, 2, 3))]
    assert order[0].source == "replica"  # (which the plan refuses unless a survivor holds rank 2's bytes)


def test_shrink_keeps_whole_replicas_that_divide_the_batch():
    lay = Layout(2, dp=3)
    completed = {r: 5 for r in range(6) if r not in (2, 3)}
    s = policy.shrink_decision(lay, [2], completed, min_dp=1, batch_size=8)  # replica 1 broken
    assert s == policy.Shrink(new_dp=2, keep=(0, 2), step=5)
    s = policy.shrink_decision(lay, [2], completed, min_dp=1, batch_size=9)  # 2 does not divide 9
    assert s == policy.Shrink(new_dp=1, keep=(0,), step=5)
    assert policy.shrink_decision(lay, [2], completed, min_dp=None, batch_size=8) is None  # not elastic
    assert policy.shrink_decision(lay, [2], completed, min_dp=3, batch_size=8) is None  # floor too high
    assert policy.shrink_decision(lay, [2], {**completed, 4: 6}, min_dp=1, batch_size=8) is None  # disagree


def test_a_shrink_keeps_a_replica_whose_lost_ranks_were_replaced_in_their_own_bundles():
    """A rank ended as blocked for good on a live node is replaced in its bundle though the lost node's ranks are
    not: its replica is kept, its new process taking its state anew; not one whose ranks are all new."""
    lay = Layout(2, dp=2)  # replicas (0, 1) and (2, 3): node B's replica lost, rank 0 ended and replaced
    s = policy.shrink_decision(lay, [2, 3], {1: 7}, min_dp=1, batch_size=8, replaced={0})
    assert s == policy.Shrink(new_dp=1, keep=(0,), step=7)
    assert policy.shrink_decision(lay, [2, 3], {1: 7}, min_dp=1, batch_size=8) is None  # rank 0 not up
    assert policy.shrink_decision(lay, [2, 3], {}, min_dp=1, batch_size=8, replaced={0, 1}) is None  # no state


def test_spares_go_to_the_lost_ranks_peers_node_and_a_lost_group_stays_on_one_node():
    nodes = ["A", "A", "B", "B"]
    ready = [("s0", "C"), ("s1", "B"), ("s2", "A")]
    assert policy.choose_spares(TP2_DP2, [3], nodes, ready) == {3: "s1"}  # peer rank 2 is on B
    assert policy.choose_spares(TP2_DP2, [1], nodes, [("s0", "C")]) == {}  # none on A: starts anew
    # replica 1 lost whole: two spares of one node, never split over nodes
    assert policy.choose_spares(TP2_DP2, [2, 3], nodes, [("s0", "C"), ("s1", "D"), ("s2", "D")]) == \
        {2: "s1", 3: "s2"}
    assert policy.choose_spares(TP2_DP2, [2, 3], nodes, [("s0", "C"), ("s1", "D")]) == {}


# -- resizing -----------------------------------------------------------------------------------
def test_resized_config_keeps_the_global_batch_and_the_micro_batch():
    cfg = job(2, 2)  # batch 8: 4 per replica, micro-batch 4
    new = policy.resized_config(cfg, cfg.layout.changed(tp=4, dp=1))
    assert (new.parallel.tp, new.parallel.dp, new.train.batch_size, new.micro_batch) == (4, 1, 8, 4)
    assert new.grad_accum_steps == 2  # one replica accumulates over the two micro-batches
    with pytest.raises(ConfigError, match="parallel.tp: 3 does not divide model.n_head=4"):
        policy.resized_config(cfg, cfg.layout.changed(tp=3, dp=1))


def test_which_ranks_a_resize_keeps_and_starts():
    tp = rank_plans.tp_resize_ranks(Layout(2, dp=2), Layout(4, dp=2))
    # ranks 4, 5 (replica 1, TP 0 and 1) go where old ranks 2, 3 run until the switch: they start then
    assert (tp.kept, tp.early, tp.late, tp.removed) == ((0, 1), (6, 7), (2, 3, 4, 5), (2, 3))
    tp = rank_plans.tp_resize_ranks(Layout(2, dp=1), Layout(4, dp=2))  # replica 1 is new: its bundles are free
    assert (tp.kept, tp.early, tp.late, tp.removed) == ((0, 1), (2, 3, 4, 5, 6, 7), (), ())
    tp = rank_plans.tp_resize_ranks(Layout(4, dp=1), Layout(1, dp=2))
    assert (tp.kept, tp.early, tp.late, tp.removed) == ((0,), (), (1,), (1, 2, 3))
    dp = rank_plans.dp_resize_ranks(2, 1, 2)
    assert (dp.kept, dp.early, dp.removed) == ((0, 1), (2, 3), ())
    dp = rank_plans.dp_resize_ranks(2, 2, 1)
    assert (dp.kept, dp.early, dp.removed) == ((0, 1), (), (2, 3))


def test_growth_requests_at_once_waits_while_none_is_placed_and_grows_as_far_as_the_placed_reach():
    assert policy.grow(Layout(1, dp=2), 2, False, 0, 8) is None
    assert policy.grow(Layout(1, dp=1), 2, False, 0, 8) == (policy.GROW_REQUEST, 2)
    assert policy.grow(Layout(1, dp=1), 2, True, 0, 8) == (policy.GROW_WAIT, 1)
    assert policy.grow(Layout(1, dp=1), 2, True, 1, 8) == (policy.GROW_NOW, 2)
    # parallel.max_dp: a node at a time, each replica placed is used at once where the batch divides
    assert policy.grow(Layout(1, dp=1), 3, True, 1, 6) == (policy.GROW_NOW, 2)
    assert policy.grow(Layout(1, dp=2), 3, True, 1, 6) == (policy.GROW_NOW, 3)
    assert policy.grow(Layout(1, dp=1), 3, True, 2, 6) == (policy.GROW_NOW, 3)
    # ... and where it does not, the next size that does waits for more
    assert policy.grow(Layout(1, dp=2), 4, True, 1, 8) == (policy.GROW_WAIT, 2)
    assert policy.grow(Layout(1, dp=2), 4, True, 2, 8) == (policy.GROW_NOW, 4)
    assert policy.grow(Layout(1, dp=1), 4, True, 2, 8) == (policy.GROW_NOW, 2)



def test_an_expert_parallel_jobs_shrink_and_growth_keep_a_layout_and_its_kept_experts_in_place():
    """At TP=1 x DP=4 x EP=2 replicas 0 and 2 hold the experts of EP place 0, 1 and 3 those of place 1; a DP
    degree must leave ep x etp dividing dp x cp x tp."""
    lay = Layout(1, dp=4, ep=2)
    assert policy.keep_replicas(lay, [0, 2, 3], 1, 8) == (0, 3)  # DP=3 no layout; (0, 2) would move experts
    assert policy.keep_replicas(lay, [2, 3], 1, 8) == (2, 3)
    assert policy.keep_replicas(lay, [0, 2], 1, 8) == (0, 2)  # no replica of place 1 left: its experts move
    assert policy.keep_replicas(lay, [1], 1, 8) is None  # DP=1 cannot hold EP=2
    assert policy.keep_replicas(Layout(2, dp=3), [0, 2], 1, 8) == (0, 2)  # dense: in the order given
    s = policy.shrink_decision(lay, [2], {r: 5 for r in (0, 1, 3)}, min_dp=1, batch_size=8)
    assert s == policy.Shrink(new_dp=2, keep=(0, 1), step=5)
    grown = Layout(1, dp=2, ep=2)
    assert policy.grow(grown, 4, True, 1, 12) == (policy.GROW_WAIT, 2)  # DP=3 no layout: waits for the 4th
    assert policy.grow(grown, 4, True, 2, 12) == (policy.GROW_NOW, 4)
    assert policy.dp_fits(grown, 2) and not policy.dp_fits(grown, 3)

# -- the loop -----------------------------------------------------------------------------------
def test_calls_are_cut_at_evaluations_checkpoints_and_the_end():
    assert policy.call_length(0, 100, 10, warm=False, eval_every=0, save_every=0) == 1  # the first step shows
    assert policy.call_length(3, 100, 10, warm=True, eval_every=0, save_every=0) == 10
    assert policy.call_length(3, 100, 10, warm=True, eval_every=5, save_every=0) == 2
    assert policy.call_length(3, 100, 10, warm=True, eval_every=0, save_every=4) == 1
    assert policy.call_length(97, 100, 10, warm=True, eval_every=0, save_every=0) == 3


def test_checkpoints_are_due_every_n_steps_and_at_the_end_once():
    assert policy.checkpoint_due(10, 25, 10, None) and policy.checkpoint_due(25, 25, 10, 20)
    assert not policy.checkpoint_due(10, 25, 10, 10)  # already saved
    assert not policy.checkpoint_due(11, 25, 10, None) and not policy.checkpoint_due(0, 25, 10, None)
    assert not policy.checkpoint_due(25, 25, 0, None)  # checkpoints off


def test_the_snapshot_keeper_goes_where_replica_0_is_not():
    one = Layout(2, dp=1)
    assert policy.keeper_node(one, ["A", "A"], ["A", "H"], here="H", current=None) == ("H", None)
    assert policy.keeper_node(one, ["A", "A"], ["A", "B", "H"], here="A", current=None) == ("B", None)
    assert policy.keeper_node(one, ["A", "A"], ["A", "B", "H"], here="H", current="B") == ("B", None)
    node, why = policy.keeper_node(one, ["A", "A"], ["A"], here="A", current=None)
    assert node is None and "no other node" in why
    node, why = policy.keeper_node(TP2_DP2, ["A", "A", "B", "B"], ["A", "B"], here="A", current=None)
    assert node is None and "DP replicas" in why


def test_snapshot_interval_keeps_their_cost_within_the_budget():
    assert policy.snapshot_interval(4, 0.03, 0.5, 0.1, False) == 4          # pinned by the job
    assert policy.snapshot_interval(0, 0.03, 0.5, 0.1, False) == 0          # off
    assert policy.snapshot_interval(None, 0.03, None, 0.1, False) == 1      # not measured yet: every step
    assert policy.snapshot_interval(None, 0.03, 0.012, 0.1, False) == 4     # 0.012 s / (3% of 0.1 s) = 4
    assert policy.snapshot_interval(None, 0.03, 0.001, 0.1, False) == 1
    assert policy.snapshot_interval(None, 0.03, 0.012, 0.1, True) == 40     # a live copy on another node
    assert policy.snapshot_interval(None, 0.01, 10.0, 0.1, False) == policy.MAX_SNAPSHOT_INTERVAL


def test_a_replica_elsewhere_is_one_on_nodes_replica_0_does_not_use():
    assert policy.replica_elsewhere(TP2_DP2, ["A", "A", "B", "B"])
    assert not policy.replica_elsewhere(TP2_DP2, ["A", "A", "A", "A"])
    assert not policy.replica_elsewhere(Layout(2, dp=1), ["A", "A"])
    assert not policy.replica_elsewhere(TP2_DP2, ["A", "A"])  # not placed yet


def test_a_layout_change_is_one_plan_chosen_by_the_layouts_alone():
    """Which kind of change a resize is, and which ranks it keeps and starts, follow from (old, new) only."""
    from raytp.runtime.elastic import changes
    one = Layout(2, dp=2)
    assert isinstance(changes.plan_change(one, one.changed(dp=3)), changes.DpChange)
    assert isinstance(changes.plan_change(one, one.changed(tp=4)), changes.TpChange)
    assert isinstance(changes.plan_change(one, one.changed(pp=2)), changes.StageChange)
    restage = changes.plan_change(Layout(2, pp=2), Layout(1, pp=2))
    assert isinstance(restage, changes.Restage) and restage.restarts_all
    assert restage.ranks == rank_plans.RankPlan((), (0, 1), (), (0, 1, 2, 3))
    assert changes.plan_change(one, one.changed(dp=3)).ranks == rank_plans.dp_resize_ranks(2, 2, 3)


def test_fits_now_packs_groups_whole_on_nodes_with_room():
    free = [{"CPU": 2.0}, {"CPU": 1.0}]
    assert policy.fits_now(free, [{"CPU": 2.0}, {"CPU": 1.0}])
    assert not policy.fits_now(free, [{"CPU": 2.0}, {"CPU": 2.0}])  # 3 CPUs free, but not 2 on two nodes
    assert not policy.fits_now(free, [{"CPU": 3.0}])  # a packed group never spans nodes
    assert not policy.fits_now([{"CPU": 4.0}], [{"CPU": 1.0, "GPU": 1.0}])  # a resource no node has
    assert policy.fits_now([], [])
    # largest first: {1} then {2} on the fullest node that holds it would strand the 2
    assert policy.fits_now([{"CPU": 1.0}, {"CPU": 2.0}], [{"CPU": 1.0}, {"CPU": 2.0}])


def test_an_ep_change_keeps_every_process_and_is_told_apart_from_the_others():
    one, two = Layout(1, dp=2, ep=1), Layout(1, dp=2, ep=2)  # what moves: test_move_plan's EP change
    assert isinstance(changes_of(two, one), changes.EpChange) and rank_plans.ep_resize_ranks(two).kept == (0, 1)


def test_a_live_change_where_experts_have_a_mesh_of_their_own_restages_unless_only_ep_or_dp_moves():
    """An EP change at the same TP, PP, DP and etp keeps every process (its dense zero 1 rows cut alike), and so
    does a DP change (each replica's experts follow its DP rank; zero 1 re-cuts their rows over the new expert-DP
    in place); any other change to, from or between expert meshes starts every worker of the new layout ahead
    (the planner moves the experts and their rows: test_moe_ep_runtime's live changes)."""
    two, z = Layout(1, dp=4, ep=2), Layout(1, dp=4, ep=2, zero=1)
    assert isinstance(changes_of(two, two.changed(ep=4)), changes.EpChange)
    assert isinstance(changes_of(z, z.changed(ep=4)), changes.EpChange)
    for old, new in ((two, two.changed(dp=2)), (two, two.changed(dp=8)), (z, z.changed(dp=2)), (z, z.changed(dp=8))):
        assert isinstance(changes_of(old, new), changes.DpChange), (old, new)
    for old, new in ((two, two.changed(tp=2)), (two, two.changed(pp=2)),
                     (two, two.changed(dp=2, ep=1)), (z, z.changed(ep=1)), (Layout(1, dp=4), two.changed(dp=2))):
        assert isinstance(changes_of(old, new), changes.Restage), (old, new)
    assert isinstance(changes_of(Layout(1, dp=4), Layout(1, dp=2)), changes.DpChange)  # a dense mesh: as ever


def test_a_scale_request_is_typed_and_names_its_target_layout():
    """What `raytp scale` files with the control actor (raytp.runtime.driver.run_status.parse): the degrees
    it names change, the others stay; --ep alone moves an MoE job's experts."""
    from raytp.runtime.driver import run_status
    ep2 = Layout(1, dp=4, ep=2)
    asked = run_status.parse({"kind": "scale", "id": 7, "ep": 4})
    assert isinstance(asked, run_status.ScaleAsked) and asked.id == 7
    assert asked.target(ep2) == Layout(1, dp=4, ep=4)
    assert run_status.parse({"kind": "scale", "id": 8, "dp": 2, "tp": None}).target(ep2) == Layout(1, dp=2, ep=2)
    with pytest.raises(ValueError):  # no layout has it: refused by the driver, by name
        run_status.parse({"kind": "scale", "id": 9, "ep": 3}).target(ep2)

def changes_of(old, new):
    return changes.plan_change(old, new)


def test_a_drain_with_no_room_elsewhere_keeps_the_replicas_clear_of_it_that_divide_the_batch():
    tp2dp4 = Layout(2, dp=4)  # replica q on node "nq"
    nodes = [f"n{r // 2}" for r in range(8)]
    assert policy.drain_keep(tp2dp4, nodes, {"n0"}, 1, 8) == (1, 2)  # 3 clear, 2 divides the batch of 8
    assert policy.drain_keep(tp2dp4, nodes, {"n0"}, 1, 6) == (1, 2, 3)
    assert policy.drain_keep(tp2dp4, nodes, {"n1", "n3"}, 1, 8) == (0, 2)
    assert policy.drain_keep(tp2dp4, nodes, {"n0"}, 3, 8) is None   # below min_dp
    assert policy.drain_keep(tp2dp4, nodes, {"n0"}, None, 8) is None  # not elastic
    assert policy.drain_keep(tp2dp4, nodes, {"x"}, 1, 8) is None    # nothing of the job is drained
    assert policy.drain_keep(tp2dp4, ["n0"] * 8, {"n0"}, 1, 8) is None  # no replica is clear
    pp2 = Layout(1, pp=2, dp=2)  # a replica's stages on two nodes: one drained stage drops its replica
    assert policy.drain_keep(pp2, ["a", "b", "c", "d"], {"b"}, 1, 4) == (1,)
    # experts on a mesh of their own: DP=1 cannot hold ep x etp = 4 (it must divide dp x tp)
    assert policy.drain_keep(Layout(2, dp=2, ep=2), ["a", "a", "b", "b"], {"a"}, 1, 4) is None
    # at DP=4 x EP=2 the replicas kept hold one copy of each expert (0 and 3, not 0 and 2)
    assert policy.drain_keep(Layout(1, dp=4, ep=2), ["a", "b", "a", "c"], {"b"}, 1, 8) == (0, 3)
