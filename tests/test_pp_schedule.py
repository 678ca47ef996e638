"""The pipeline schedule tables are right: every action once, matched sends, no deadlock, and the step's idle
share, activations held and warm-up counts equal the closed forms of Narayanan et al. (2021)."""
from fractions import Fraction

import pytest

from raytp.parallel.pipeline.pp_schedule import (
    SCHEDULES, Action, ScheduleError, bubble, check, interleaved_1f1b, one_f_one_b, peers, schedule, simulate)

F = lambda mb, c: Action("F", mb, c)  # noqa: E731
B = lambda mb, c: Action("B", mb, c)  # noqa: E731

ONE_F_ONE_B = [(p, m) for p in range(1, 9) for m in range(1, 33)]
INTERLEAVED = [(p, m, v) for v in (2, 3) for p in range(1, 9) for m in range(p, 33, p)]


def test_1f1b_p2_m3_is_the_hand_written_table():
    assert one_f_one_b(2, 3) == [
        [F(0, 0), F(1, 0), B(0, 0), F(2, 0), B(1, 0), B(2, 0)],
        [F(0, 1), B(0, 1), F(1, 1), B(1, 1), F(2, 1), B(2, 1)],
    ]


def test_1f1b_p2_m3_start_times_by_hand():
    tl = simulate(one_f_one_b(2, 3), 2, t_f=1, t_b=2)
    assert [tl.start[a] for a in one_f_one_b(2, 3)[0]] == [0, 1, 4, 6, 7, 10]   # B(1) waits for stage 1's
    assert [tl.start[a] for a in one_f_one_b(2, 3)[1]] == [1, 2, 4, 5, 7, 8]
    assert tl.makespan == 12


def test_every_table_passes_check():
    for p, m in ONE_F_ONE_B:
        check(one_f_one_b(p, m), p, m)
    for p, m, v in INTERLEAVED:
        check(interleaved_1f1b(p, m, v), p, m, v)


@pytest.mark.parametrize("t_f, t_b", [(1, 2), (1, 1), (2, 3)])
def test_1f1b_idle_share_is_the_bubble(t_f, t_b):
    for p, m in ONE_F_ONE_B:
        tl = simulate(one_f_one_b(p, m), p, t_f=t_f, t_b=t_b)
        assert tl.makespan == (m + p - 1) * (t_f + t_b), (p, m)  # fill + m steady slots + drain, by hand
        for s in range(p):
            assert tl.busy[s] == m * (t_f + t_b)
            assert tl.idle(s) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m, s)
            assert tl.idle(s) == pytest.approx(bubble(p, m), abs=1e-12)


@pytest.mark.parametrize("t_f, t_b", [(1, 2), (1, 1), (2, 3)])
def test_interleaved_idle_share_is_its_bubble_exactly(t_f, t_b):
    # Found by simulation and held here for every case: the step lasts (v*m + p - 1) chunk slots, so each
    # stage idles exactly (p-1)/(v*m+p-1) of it (Megatron's bubble (p-1)/v of a stage's time).
    for p, m, v in INTERLEAVED:
        tl = simulate(interleaved_1f1b(p, m, v), p, v, t_f, t_b)
        assert tl.makespan == (v * m + p - 1) * (t_f + t_b), (p, m, v)
        for s in range(p):
            assert tl.busy[s] == v * m * (t_f + t_b)
            assert tl.idle(s) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v, s)
            assert tl.idle(s) == pytest.approx(bubble(p, m, v), abs=1e-12)


def test_interleaving_shortens_the_step_of_the_same_model():
    # A chunk is 1/v of a stage's layers: run it in 1/v of the time (exact fractions) and compare whole steps.
    for p, m, v in INTERLEAVED:
        if p == 1:
            continue
        plain = simulate(one_f_one_b(p, m), p, t_f=1, t_b=2)
        inter = simulate(interleaved_1f1b(p, m, v), p, v, t_f=Fraction(1, v), t_b=Fraction(2, v))
        assert inter.busy == plain.busy
        assert inter.makespan < plain.makespan, (p, m, v)
        assert bubble(p, m, v) < bubble(p, m)


def test_1f1b_stage_s_holds_at_most_p_minus_s_micro_batches_and_reaches_it():
    for p, m in ONE_F_ONE_B:
        assert simulate(one_f_one_b(p, m), p).held == tuple(min(p - s, m) for s in range(p)), (p, m)


def test_interleaved_holds_its_warm_up_plus_one_chunk_activations():
    for p, m, v in INTERLEAVED:
        want = tuple(min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p))
        assert simulate(interleaved_1f1b(p, m, v), p, v).held == want, (p, m, v)


def test_1f1b_warm_up_is_p_minus_s_minus_1_forwards():
    for p, m in ONE_F_ONE_B:
        for s, acts in enumerate(one_f_one_b(p, m)):
            warm = min(p - s - 1, m)
            assert "".join(a.kind for a in acts) == "F" * warm + "FB" * (m - warm) + "B" * warm, (p, m, s)


def test_1f1b_runs_micro_batches_in_increasing_order_on_every_stage():
    for p, m in ONE_F_ONE_B:
        for s, acts in enumerate(one_f_one_b(p, m)):
            for kind in "FB":
                assert [a.mb for a in acts if a.kind == kind] == list(range(m))
            assert {a.chunk for a in acts} == {s}


def test_every_send_has_its_receive():
    for p, m, v in [(p, m, 1) for p, m in ONE_F_ONE_B] + INTERLEAVED:
        table = interleaved_1f1b(p, m, v)
        where = {a: s for s, acts in enumerate(table) for a in acts}
        for a, s in where.items():
            src, dst = peers(a, p, v)
            if dst is not None:
                nxt = F(a.mb, a.chunk + 1) if a.kind == "F" else B(a.mb, a.chunk - 1)
                assert where[nxt] == dst and peers(nxt, p, v)[0] == s, (p, m, v, a)
            if src is not None:
                prev = F(a.mb, a.chunk - 1) if a.kind == "F" else B(a.mb, a.chunk + 1)
                assert where[prev] == src and peers(prev, p, v)[1] == s, (p, m, v, a)


def test_peers_at_the_ends_and_across_the_wrap():
    assert peers(F(0, 0), 3, 2) == (None, 1)
    assert peers(F(0, 2), 3, 2) == (1, 0)       # chunk 3 lives on stage 0
    assert peers(F(0, 5), 3, 2) == (1, None)
    assert peers(B(0, 5), 3, 2) == (None, 1)    # the last chunk's backward starts from its own loss
    assert peers(B(0, 3), 3, 2) == (1, 2)
    assert peers(B(0, 0), 3, 2) == (1, None)


def test_interleaved_with_one_virtual_stage_is_1f1b():
    for p, m in ONE_F_ONE_B:
        assert interleaved_1f1b(p, m, 1) == one_f_one_b(p, m)


def test_interleaved_p2_m4_v2_is_the_hand_written_table():
    # Forwards go through a stage's chunks in groups of p micro-batches, backwards through them in reverse;
    # stage s warms up with 2(p-s-1) + (v-1)p forwards.
    assert interleaved_1f1b(2, 4, 2) == [
        [F(0, 0), F(1, 0), F(0, 2), F(1, 2), F(2, 0), B(0, 2), F(3, 0), B(1, 2),
         F(2, 2), B(0, 0), F(3, 2), B(1, 0), B(2, 2), B(3, 2), B(2, 0), B(3, 0)],
        [F(0, 1), F(1, 1), F(0, 3), B(0, 3), F(1, 3), B(1, 3), F(2, 1), B(0, 1),
         F(3, 1), B(1, 1), F(2, 3), B(2, 3), F(3, 3), B(3, 3), B(2, 1), B(3, 1)],
    ]


def test_schedule_by_name():
    assert SCHEDULES == ("1f1b", "interleaved")
    assert schedule("1f1b", 3, 5) == one_f_one_b(3, 5)
    assert schedule("interleaved", 2, 4, 2) == interleaved_1f1b(2, 4, 2)
    with pytest.raises(ScheduleError, match=r"unknown pipeline schedule 'gpipe'; choices: 1f1b, interleaved"):
        schedule("gpipe", 2, 4)
    with pytest.raises(ScheduleError, match=r"one chunk per stage \(v=1\), got v=2"):
        schedule("1f1b", 2, 4, 2)


@pytest.mark.parametrize("args, message", [
    ((4, 6, 2), r"multiple of the pipeline degree.*m=6, p=4 \(use m = 4 or 8, or the '1f1b' schedule\)"),
    ((4, 3, 2), r"m=3, p=4 \(use m = 4, or"),
    ((2, 4, 0), r"v \(virtual stages\) must be >= 1, got 0"),
    ((2, 0, 2), r"m \(micro-batches\) must be >= 1, got 0"),
    ((0, 4, 2), r"p \(pipeline stages\) must be >= 1, got 0"),
])
def test_interleaved_refuses_what_megatron_refuses(args, message):
    with pytest.raises(ScheduleError, match=message):
        interleaved_1f1b(*args)


def broken(edit):
    table = one_f_one_b(2, 3)  # [[F0 F1 B0 F2 B1 B2], [F0 B0 F1 B1 F2 B2]]
    edit(table)
    return table


@pytest.mark.parametrize("table, message", [
    (broken(lambda t: t[0].remove(B(2, 0))), r"^B\(mb=2, chunk=0\) is missing \(stage 0\)$"),
    (broken(lambda t: t[1].append(F(1, 1))), r"^F\(mb=1, chunk=1\) appears 2 times \(stage 1\)$"),
    (broken(lambda t: t[0].insert(0, t[0].pop(2))), r"^stage 0 runs B\(mb=0, chunk=0\) before its forward$"),
    ([[F(0, 0), F(2, 0), B(0, 0), F(1, 0), B(1, 0), B(2, 0)], one_f_one_b(2, 3)[1]],
     r"^stage 0 runs the forwards of chunk 0 in micro-batch order \[0, 2, 1\], not increasing$"),
    ([one_f_one_b(2, 3)[0], [F(0, 1), F(1, 1), B(1, 1), B(0, 1), F(2, 1), B(2, 1)]],
     r"^stage 1 runs the backwards of chunk 1 in micro-batch order \[1, 0, 2\], not increasing$"),
    (broken(lambda t: t[0].append(F(0, 1))), r"^stage 0 runs F\(mb=0, chunk=1\), but chunk 1 lives on stage 1$"),
    (broken(lambda t: t[0].append(F(3, 0))), r"^stage 0 runs F\(mb=3, chunk=0\), but m=3 and p\*v=2"),
    (broken(lambda t: t.pop()), r"^the table has 1 stages, but p=2$"),
])
def test_check_rejects_a_broken_table(table, message):
    with pytest.raises(ScheduleError, match=message):
        check(table, 2, 3)


def test_check_rejects_a_table_that_deadlocks():
    # Each step of it is fine alone: stage 0 backs up each micro-batch at once (no warm-up) while stage 1
    # runs all its forwards first, so stage 0 waits for a gradient that stage 1 sends only after a forward
    # that stage 0 has not sent yet.
    table = [[F(0, 0), B(0, 0), F(1, 0), B(1, 0)],
             [F(0, 1), F(1, 1), B(0, 1), B(1, 1)]]
    with pytest.raises(ScheduleError, match=r"^the schedule deadlocks: stage 0 waits at B\(mb=0, chunk=0\) for "
                                            r"B\(mb=0, chunk=1\); stage 1 waits at F\(mb=1, chunk=1\) for "
                                            r"F\(mb=1, chunk=0\)$"):
        check(table, 2, 2)


def test_check_rejects_stage_0_running_all_its_backwards_first():
    table = one_f_one_b(2, 2)
    table[0] = [a for a in table[0] if a.kind == "B"] + [a for a in table[0] if a.kind == "F"]
    with pytest.raises(ScheduleError, match=r"^stage 0 runs B\(mb=0, chunk=0\) before its forward$"):
        check(table, 2, 2)
    with pytest.raises(ScheduleError, match=r"^the schedule deadlocks: stage 0 waits at B\(mb=0, chunk=0\) for "
                                            r"B\(mb=0, chunk=1\); stage 1 waits at F\(mb=0, chunk=1\) for "
                                            r"F\(mb=0, chunk=0\)$"):
        simulate(table, 2)


def test_an_action_is_forward_or_backward():
    with pytest.raises(ScheduleError, match=r"'F' or 'B', not 'W'"):
        Action("W", 0, 0)
