"""The expert_imbalance event: told once when a layer stays above the threshold for the steps it needs, again
only after it came back under (raytp.runtime.driver.watches, pure)."""
from raytp.runtime.driver.watches import ImbalanceWatch


def rec(step, **layers):
    return {"step": step, "experts": {k.removeprefix("l"): {"imbalance": v} for k, v in layers.items()}}


def test_a_layer_above_the_threshold_long_enough_is_told_once_then_again_after_it_recovered():
    w = ImbalanceWatch(threshold=2.0, steps=3)
    assert w.observe({"step": 0}) is None  # a dense model's record
    assert [w.observe(rec(s, l1=2.5, l3=1.1)) for s in range(2)] == [None, None]
    told = w.observe(rec(2, l1=2.5, l3=1.1))
    assert told == {"layers": [1], "imbalance": [2.5], "since_step": [0], "threshold": 2.0, "steps": 3}
    assert w.observe(rec(3, l1=3.0, l3=1.1)) is None  # still above: not told twice
    assert w.observe(rec(4, l1=1.5, l3=2.1)) is None  # 1 recovered; 3 just went above
    assert w.observe(rec(5, l1=2.2, l3=2.1)) is None
    assert w.observe(rec(6, l1=2.2, l3=2.1))["layers"] == [3]
    assert w.observe(rec(7, l1=2.2, l3=2.1))["layers"] == [1]  # above again for 3 steps since step 5
