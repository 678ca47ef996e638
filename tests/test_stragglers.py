"""Finding the rank that holds the others back: the pure tracker, and a rank slowed on purpose in a real job
being named (metrics.jsonl's `straggler`, a `straggler` event)."""
import json

import pytest

from faulty import SlowData
from helpers import events, job, run
from raytp.runtime.driver.watches import STRAGGLER_STEPS as STEPS, Stragglers, slowest


def test_slowest_names_the_rank_and_its_ratio_to_the_median():
    assert slowest([0.1]) is None
    s = slowest([0.10, 0.30, 0.12, 0.11])
    assert s["rank"] == 1 and s["compute_s"] == 0.30 and s["median_s"] == pytest.approx(0.115)
    assert s["ratio"] == pytest.approx(0.30 / 0.115)


def test_a_rank_is_named_once_after_staying_slowest_and_again_only_after_a_change():
    t = Stragglers(ratio=1.5)
    slow1, slow2, even = slowest([1.0, 2.0, 1.0]), slowest([1.0, 1.0, 2.0]), slowest([1.0, 1.1, 1.0])
    told = [t.observe(step, slow1) for step in range(STEPS + 3)]
    assert [e is not None for e in told] == [False] * (STEPS - 1) + [True] + [False] * 3
    assert told[STEPS - 1]["rank"] == 1 and told[STEPS - 1]["steps"] == STEPS
    assert all(t.observe(step, slow2) is None for step in range(STEPS - 1))  # another rank: counted anew
    assert t.observe(99, slow2)["rank"] == 2
    t.observe(100, even)  # within the ratio: the run ends
    assert all(t.observe(step, slow2) is None for step in range(STEPS - 1)) and t.observe(9, slow2)["rank"] == 2


@pytest.mark.slow  # over 10 s: the full suite's, not the quick tier's
def test_a_worker_slowed_on_purpose_is_named_the_straggler(ray_local, tmp_path):
    run_dir = tmp_path / "run"
    # 2 x STEPS + 1 steps after the first: one step the load hides still leaves STEPS slow steps in a row.
    run(job(1, 2, steps=2 * STEPS + 2), run_dir, "slow", worker_cls=SlowData)
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    # Rank 1's compute holds its sleep; rank 0's holds none (its wait for rank 1 is collective time). A host
    # loaded by the suite beside it may deschedule rank 0 for longer than the sleep in one step, not in two.
    named = [m["straggler"]["rank"] == 1 and m["straggler"]["compute_s"] > SlowData.delay_s
             and m["straggler"]["ratio"] > 1.2 for m in metrics[1:]]  # 1.2: runtime.straggler_ratio's default
    assert sum(named) >= len(named) - 1, [m["straggler"] for m in metrics]
    (named,) = events(run_dir, "straggler")
    assert named["rank"] == 1 and named["steps"] == STEPS and named["ratio"] > 1.2
