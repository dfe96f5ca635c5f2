"""Roles for auto workers: the split the load wants, reached slowly (fake clock, no engine).

With this profile and the mixed workload, two workers are best as 1P1D at light load, as one
decode and one `both` worker when the one decode worker nears saturation (~5 req/s), and as
two `both` workers beyond (capacity.py); boundaries are found by bisection on the model."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.planner.capacity import Demand, Slo, Split, predict
from pdserve.planner.costmodel import Profile
from pdserve.planner.roles import Memory, PoolView, PoolWorker, RolePlanner, Smoothed

P = Profile(prefill_base_s=0.01, prefill_per_token_s=1e-4, step_base_s=0.004,
            step_per_running_s=0.0016, handoff_s=0.05)
SLO = Slo(ttft_ms=2000, tpot_ms=18)
PLANNER = RolePlanner(SLO, hold_seconds=30, cooldown_seconds=60)


def mixed(rate: float) -> Demand:
    return Demand(rate, 595.0, 99.2, 0.3 * 1750**2 + 0.7 * 100**2)


def view(roles: dict[str, str], demand: Demand, running: dict[str, int] | None = None,
         fixed: tuple[str, ...] = ()) -> PoolView:
    running = running or {}
    return PoolView(tuple(PoolWorker(w, r, auto=w not in fixed, running=running.get(w, 0))
                          for w, r in sorted(roles.items())), demand, P)


def drive(roles: dict[str, str], rate_at, until: int, planner: RolePlanner = PLANNER,
          running: dict[str, int] | None = None, statuses: list[str] | None = None):
    """Tick every second from 0 to `until`, applying each change; (time, change) pairs."""
    memory, changes = Memory(), []
    for now in range(until + 1):
        d = planner.decide(memory, view(roles, mixed(rate_at(now)), running), float(now))
        memory = d.memory
        if statuses is not None:
            statuses.append(d.status)
        for c in d.changes:
            assert roles[c.worker] == c.old
            roles[c.worker] = c.new
            changes.append((now, c))
    return changes


def boundary(split: Split, slack: float) -> float:
    """The rate at which `split`'s predicted slack falls to `slack`."""
    lo, hi = 0.5, 10.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(split, mixed(mid), P).slack(SLO) > slack else (lo, mid)
    return lo


ONE_P_ONE_D, ONE_D_ONE_B = Split(1, 1, 0), Split(0, 1, 1)
# 1P1D is kept up to STAY_1P1D, returned to below ENTER_1P1D; likewise 0P1D+1B.
STAY_1P1D = boundary(ONE_P_ONE_D, PLANNER.stay_headroom)
ENTER_1P1D = boundary(ONE_P_ONE_D, PLANNER.enter_headroom)
ENTER_1D1B = boundary(ONE_D_ONE_B, PLANNER.enter_headroom)


def test_the_model_behind_these_tests():
    assert 4.0 < ENTER_1P1D < STAY_1P1D < ENTER_1D1B < 5.5
    assert predict(Split(1, 1, 0), mixed(2), P).slack(SLO) > 0.5
    assert predict(Split(1, 1, 0), mixed(5.5), P).slack(SLO) < 0
    assert predict(Split(0, 0, 2), mixed(5.5), P).slack(SLO) > PLANNER.enter_headroom


def test_light_load_keeps_1p1d():
    roles = {"a": "prefill", "b": "decode"}
    assert drive(roles, lambda t: 2.0, 600) == []
    assert roles == {"a": "prefill", "b": "decode"}


def test_a_sustained_shift_makes_exactly_one_change_after_hold_seconds():
    roles = {"a": "prefill", "b": "decode"}
    changes = drive(roles, lambda t: 2.0 if t < 100 else 5.5, 189)
    assert len(changes) == 1
    when, c = changes[0]
    assert when == 100 + PLANNER.hold_seconds
    # Toward all-both, the move that predicts best: the prefill worker also decodes.
    assert (c.worker, c.old, c.new, c.why) == ("a", "prefill", "both", "decode_saturated")
    assert "1P1D -> 0P1D+1B" in c.detail


def test_the_next_change_waits_for_the_cooldown():
    roles = {"a": "prefill", "b": "decode"}
    changes = drive(roles, lambda t: 2.0 if t < 100 else 5.5, 400)
    assert [t for t, _ in changes] == [130, 130 + PLANNER.cooldown_seconds]
    assert roles == {"a": "both", "b": "both"}
    assert drive(dict(roles), lambda t: 5.5, 600) == []  # and there it stays


def test_noisy_load_at_the_saturation_boundary_does_not_flap():
    # Noise across the rate where 1P1D stops meeting the SLO: the wish to move comes and goes,
    # never for hold_seconds in a row.
    rng = np.random.default_rng(0)
    noise = rng.uniform(STAY_1P1D - 0.3, STAY_1P1D + 0.3, size=1801)
    roles, seen = {"a": "prefill", "b": "decode"}, []
    assert drive(roles, lambda t: float(noise[t]), 1800, statuses=seen) == []
    assert 0.3 < seen.count("holding") / len(seen) < 0.7  # the wish did come, and go


@pytest.mark.parametrize("start, enter", [({"a": "both", "b": "decode"}, ENTER_1P1D),
                                          ({"a": "both", "b": "both"}, ENTER_1D1B)])
def test_noisy_load_at_a_return_boundary_does_not_flap(start, enter):
    # A split with fewer `both` workers becomes good enough to return to below `enter`.
    rng = np.random.default_rng(1)
    noise = rng.uniform(enter - 0.3, enter + 0.3, size=1801)
    roles, seen = dict(start), []
    assert drive(roles, lambda t: float(noise[t]), 1800, statuses=seen) == []
    assert roles == start
    assert 0.3 < seen.count("holding") / len(seen) < 0.7


def test_between_the_boundaries_neither_split_moves():
    # The stay/enter headrooms leave a band where 1P1D is kept but not returned to.
    rate = (ENTER_1P1D + STAY_1P1D) / 2
    for start in ({"a": "prefill", "b": "decode"}, {"a": "both", "b": "decode"}):
        roles = dict(start)
        assert drive(roles, lambda t: rate, 900) == []
        assert roles == start


def test_load_falling_back_returns_to_disaggregated():
    roles = {"a": "both", "b": "both"}
    changes = drive(roles, lambda t: 2.0, 400)
    assert [(t, c.why) for t, c in changes] == [(30, "steadier"), (90, "steadier")]
    assert sorted(roles.values()) == ["decode", "prefill"]


def test_near_saturation_one_worker_takes_both_roles():
    roles = {"a": "prefill", "b": "decode"}
    rate = (STAY_1P1D + ENTER_1D1B) / 2  # 1P1D misses, 0P1D+1B meets with headroom
    changes = drive(roles, lambda t: rate, 600)
    assert [(t, c.worker, c.new) for t, c in changes] == [(30, "a", "both")]


def test_fixed_workers_never_change_and_the_least_busy_auto_worker_moves():
    # Long prompts, short answers: one prefill worker saturates. (Not too short: with the
    # first token from the prefill, a 50 ms handoff gap over 3 gaps alone breaks the TPOT SLO.)
    demand = Demand(4.8, 2000.0, 64.0)
    roles = {"p": "prefill", "d1": "decode", "d2": "decode"}
    v = PoolView(tuple(PoolWorker(w, r, auto=w != "p", running={"d1": 5, "d2": 1}.get(w, 0))
                       for w, r in sorted(roles.items())), demand, P)
    d = PLANNER.decide(Memory(since=0.0), v, 100.0)
    assert [(c.worker, c.old, c.new, c.why) for c in d.changes] == [
        ("d2", "decode", "prefill", "prefill_saturated")]


def test_decisions_are_pure_functions_of_memory_view_and_now():
    v = view({"a": "prefill", "b": "decode"}, mixed(5.5))
    first = PLANNER.decide(Memory(since=10.0), v, 45.0)
    again = PLANNER.decide(Memory(since=10.0), v, 45.0)
    assert first == again and first.status == "changed"
    assert PLANNER.decide(Memory(since=10.0), v, 30.0).status == "holding"
    assert PLANNER.decide(Memory(since=10.0, last_change=0.0), v, 45.0).status == "cooldown"


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_desired_workers_is_the_fewest_that_meet_the_slo(role):
    demand = mixed(100.0)
    n = PLANNER.desired_workers(role, view({}, demand))
    h = PLANNER.enter_headroom
    big = 10**6

    def meets(k: int) -> bool:
        split = {"prefill": Split(k, big, 0), "decode": Split(big, k, 0),
                 "both": Split(0, 0, k)}[role]
        p = predict(split, demand, P)
        ttft, tpot = {"prefill": (p.ttft_s, 0.0), "decode": (0.0, p.tpot_s),
                      "both": (p.ttft_s, p.tpot_s)}[role]
        return SLO.slack(ttft, tpot) >= h

    assert meets(n) and not meets(n - 1)
    assert PLANNER.desired_workers(role, view({}, mixed(200.0))) > n


def test_planning_512_auto_workers_is_quick():
    import time

    roles = {f"w{i:03}": "prefill" if i < 64 else "decode" for i in range(512)}
    v = view(roles, mixed(1500.0))
    t0 = time.perf_counter()
    d = PLANNER.decide(Memory(), v, 0.0)
    assert time.perf_counter() - t0 < 1.0
    assert d.target.split.workers == 512


def test_smoothed_signal_halves_the_gap_each_half_life():
    s = Smoothed().update(0.0, 0.0, 10.0)
    s = s.update(100.0, 10.0, 10.0)
    assert s.value == pytest.approx(50.0)
    s = s.update(100.0, 20.0, 10.0)
    assert s.value == pytest.approx(75.0)
    assert s.update(100.0, 20.0, 10.0).value == pytest.approx(75.0)  # no time, no change
