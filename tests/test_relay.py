"""Which rank hands a streamed call to which (raytp.runtime.cluster.relay.relay_plan): pure, no Ray."""
from raytp.parallel.layout import Layout
from raytp.runtime.cluster.relay import relay_plan
from raytp.runtime.cluster.streaming import direct_ranks, reporting_ranks


def test_every_rank_not_called_directly_is_led_by_the_first_rank_of_its_node_in_runs_of_fan_out():
    nodes = ["a"] * 8 + ["b"] * 8 + ["c"] * 3
    plan = relay_plan({0, 1}, nodes, fan_out=4)
    assert plan == {2: [3, 4, 5, 6], 7: [], 8: [9, 10, 11, 12], 13: [14, 15], 16: [17, 18]}
    reached = sorted([lead for lead in plan] + [p for peers in plan.values() for p in peers])
    assert reached == list(range(2, 19))  # each rank once, none of the direct ones


def test_a_rank_whose_node_is_unknown_leads_itself_and_no_nodes_means_no_relays():
    assert relay_plan(set(), ["a", None, "a"]) == {0: [2], 1: []}
    assert relay_plan({0}, []) == {}


def test_direct_ranks_are_the_reporters_and_the_owners_only():
    lay = Layout(8, dp=128)
    assert reporting_ranks(lay) == [0]
    assert direct_ranks(lay) == list(range(8))  # replica 0 owns the state (raytp.parallel.ownership)
    nodes = [f"n{r // 8}" for r in range(lay.world_size)]
    plan = relay_plan(direct_ranks(lay), nodes, fan_out=16)
    assert len(plan) == 127 and all(len(peers) == 7 for peers in plan.values())
    assert reporting_ranks(Layout(2, pp=3, dp=2)) == [0, 4]  # the last stage holds the loss
