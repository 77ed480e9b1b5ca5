"""Schedules as instruction lists: generation for any P and M, the validator, bubbles against theory."""

from __future__ import annotations

import pytest

from vescale.pipe import (
    Action,
    PipeSchedule,
    ScheduleError,
    add_communication,
    build_schedule,
    register_schedule,
    schedule_names,
    validate_schedule,
)

NATURAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(NATURAL))
def test_builtin_schedules_are_valid(name, P, mult):
    M = P * mult
    sched = build_schedule(name, P, M, NATURAL[name] * P)
    report = validate_schedule(sched)
    ops = [a for acts in sched.actions for a in acts]
    S = NATURAL[name] * P
    # every (stage, microbatch) is forwarded once and backwarded once (whole or split)
    assert sorted((a.stage, a.mb) for a in ops if a.op == "F") == [(s, m) for s in range(S) for m in range(M)]
    split = name.startswith("zb")
    assert sum(a.op == ("BI" if split else "B") for a in ops) == S * M
    assert sum(a.op == "BW" for a in ops) == (S * M if split else 0)
    assert 0 <= report.bubble_fraction < 1


@pytest.mark.parametrize("P,M", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 16)])
def test_bubbles_match_theory(P, M):
    """1F1B's idle/busy ratio is exactly (P-1)/M; ZB-H1 reaches a third of it; interleaving divides it by V."""
    one = validate_schedule(build_schedule("1f1b", P, M))
    assert one.bubble_ratio == pytest.approx((P - 1) / M)
    assert validate_schedule(build_schedule("gpipe", P, M)).bubble_ratio == pytest.approx((P - 1) / M)
    zb = validate_schedule(build_schedule("zb_h1", P, M))
    assert zb.bubble_ratio <= (P - 1) / M / 3 + 0.03  # unit costs F = BI = BW; ideal (P-1)/(3M)
    for V in (2, 3, 4):
        inter = validate_schedule(build_schedule("interleaved_1f1b", P, M, V * P))
        assert inter.bubble_ratio == pytest.approx((P - 1) / M / V)
        assert validate_schedule(build_schedule("gpipe", P, M, V * P)).bubble_fraction < 1
    assert validate_schedule(build_schedule("zbv", P, M)).bubble_ratio < zb.bubble_ratio


def test_too_few_microbatches_is_a_clear_error():
    for name, M in (("1f1b", 3), ("zb_h1", 2), ("zbv", 3), ("interleaved_1f1b", 6)):
        with pytest.raises(ScheduleError, match="microbatches"):
            build_schedule(name, 4, M)
    with pytest.raises(ScheduleError, match="two stages per rank"):
        build_schedule("zbv", 2, 4, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'"):
        build_schedule("nope", 2, 2)


def _edit(sched: PipeSchedule, rank: int, fn) -> PipeSchedule:
    actions = [list(a) for a in sched.actions]
    actions[rank] = fn(actions[rank])
    return PipeSchedule(sched.name, actions, sched.stage_to_rank, sched.num_microbatches)


def test_validator_catches_hand_broken_schedules():
    good = build_schedule("1f1b", 2, 2)
    assert str(good.actions[1][0]) == "RECV_F(s1,m0)"
    # missing dependency: rank 1 forgets to receive its input before the forward
    broken = _edit(good, 1, lambda acts: [a for a in acts if a != Action("RECV_F", 1, 0)])
    with pytest.raises(ScheduleError, match=r"RECV_F\(s1,m0\) on rank 1|missing dependency"):
        validate_schedule(broken)
    # deadlock: rank 0 waits for a gradient before sending the activation that produces it
    def swap(acts):
        i, j = acts.index(Action("SEND_F", 0, 0)), acts.index(Action("RECV_B", 0, 0))
        acts.insert(j, acts.pop(i))
        return acts
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits at RECV_B"):
        validate_schedule(_edit(good, 0, swap))
    # a backward-weight before its backward-input
    zb = build_schedule("zb_h1", 2, 2)
    def early_w(acts):
        i = acts.index(Action("BW", 1, 0))
        acts.insert(0, acts.pop(i))
        return acts
    with pytest.raises(ScheduleError, match=r"BW\(s1,m0\) needs its input-gradient backward"):
        validate_schedule(_edit(zb, 1, early_w))
    # a lost microbatch
    with pytest.raises(ScheduleError, match=r"F\(s0,m1\) is missing|has no matching"):
        validate_schedule(_edit(good, 0, lambda acts: [a for a in acts if a.mb != 1]))
    # a stage on the wrong rank
    with pytest.raises(ScheduleError, match="placed on rank 1"):
        validate_schedule(_edit(good, 0, lambda acts: acts + [Action("F", 1, 0)]))


def _reverse_gpipe(P: int, M: int, S: int) -> PipeSchedule:
    """A user schedule: GPipe that runs the microbatches' backwards in reverse order."""
    place = list(range(P))
    compute = [[Action("F", r, m) for m in range(M)] + [Action("B", r, m) for m in reversed(range(M))]
               for r in range(P)]
    return PipeSchedule("reverse_gpipe", add_communication(compute, place), place, M)


def test_register_user_schedule():
    register_schedule("reverse_gpipe_test", _reverse_gpipe, overwrite=True)
    assert "reverse_gpipe_test" in schedule_names()
    sched = build_schedule("reverse_gpipe_test", 3, 4)
    report = validate_schedule(sched)
    assert report.makespan == pytest.approx(validate_schedule(build_schedule("gpipe", 3, 4)).makespan)
    with pytest.raises(ScheduleError, match="already registered"):
        register_schedule("reverse_gpipe_test", _reverse_gpipe)
