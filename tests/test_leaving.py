"""Which survivors still inside a failed step after the abort are blocked for good (raytp.runtime.leaving):
judged by the CPU their process used since, without Ray."""
import pytest

from raytp.runtime.leaving import IDLE_CPU_SHARE, STACKS_AFTER_S, blocked_for_good, cpu_shares


def test_an_idle_process_is_blocked_for_good_and_a_computing_one_is_waited_for():
    before = {0: 10.0, 1: 20.0, 2: 3.0, 3: None}
    after = {0: 10.05, 1: 22.5, 2: 3.0 + IDLE_CPU_SHARE * STACKS_AFTER_S, 3: 4.0}
    shares = cpu_shares(before, after, STACKS_AFTER_S)
    assert shares == pytest.approx({0: 0.05 / STACKS_AFTER_S, 1: 2.5 / STACKS_AFTER_S, 2: IDLE_CPU_SHARE})
    assert 3 not in shares  # no reading before
    assert blocked_for_good(shares) == [0]  # rank 2, at the share exactly, is not idle
    assert blocked_for_good({}) == []
