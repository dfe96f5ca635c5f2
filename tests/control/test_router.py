"""Routing policies over registry snapshots (pure logic, fake clock)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdserve.controller.registry import Registry
from pdserve.controller.router import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    LeastLoaded,
    PowerOfTwo,
    PrefixAware,
    RoundRobin,
    make_policy,
)
from pdserve.protocol import EngineInfo, Load, Register, Role

INFO = EngineInfo("m", "m", 16, "float32", "nixl", 4096)


def pool(n: int, role=Role.PREFILL) -> Registry:
    reg = Registry(INFO, clock=lambda: 0.0)
    for i in range(n):
        reg.register(Register(f"w{i}", role, "h", INFO), f"w{i}".encode())
    return reg


def route(policy, reg, prompt=(), side=Role.PREFILL):
    w = policy.choose(reg.ready(side), prompt)
    policy.routed(w, prompt)
    return w


def test_round_robin_cycles_in_id_order_whatever_the_input_order():
    reg = pool(3)
    rr = RoundRobin()
    picks = [rr.choose(list(reversed(reg.ready(Role.PREFILL)))).id for _ in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_least_loaded_prefers_the_lowest_score_then_kv_usage():
    reg = pool(3)
    w0, w1, w2 = (reg.workers[f"w{i}"] for i in range(3))
    w0.load, w1.load, w2.load = Load(running=2), Load(running=1, kv_usage=0.9), Load(waiting=1)
    ll = LeastLoaded()
    assert ll.choose(reg.ready(Role.PREFILL)).id == "w2"  # score 1 ties w1; less KV in use
    w2.inflight = 3  # our own in-flight requests count too
    assert ll.choose(reg.ready(Role.PREFILL)).id == "w1"


def test_our_requests_count_from_our_books_not_from_a_stale_report():
    # After a burst: w0 and w1 each last reported two of our legs, which have finished since;
    # w2 last reported idle, just before we sent it a long stream. The reports are up to a
    # heartbeat old, so the busy worker must not look idler than the two idle ones.
    reg = pool(3, Role.DECODE)
    w0, w1, w2 = (reg.workers[f"w{i}"] for i in range(3))
    for w in (w0, w1):
        w.inflight = 2
        reg.heartbeat(w.id, Load(running=2), draining=False)
        w.inflight = 0
    reg.heartbeat("w2", Load(), draining=False)
    w2.inflight = 1
    assert [w.score() for w in (w0, w1, w2)] == [0, 0, 1]
    assert LeastLoaded().choose(reg.ready(Role.DECODE)).id == "w0"
    # Another controller's requests in the report still count.
    reg.heartbeat("w0", Load(running=3), draining=False)
    assert w0.score() == 3
    assert LeastLoaded().choose(reg.ready(Role.DECODE)).id == "w1"


def test_least_loaded_spreads_one_at_a_time_arrivals_and_is_reproducible():
    reg = pool(4)
    ll = LeastLoaded()
    picks = [route(ll, reg).id for _ in range(8)]
    assert picks == ["w0", "w1", "w2", "w3"] * 2
    assert [route(LeastLoaded(), reg).id for _ in range(1)] == ["w0"]


def test_least_loaded_distribution_under_concurrency():
    reg = pool(4)
    ll = LeastLoaded()
    for _ in range(40):
        route(ll, reg).inflight += 1  # nothing finishes
    assert sorted(w.inflight for w in reg.workers.values()) == [10, 10, 10, 10]


def test_power_of_two_picks_the_lighter_of_two_and_spreads():
    reg = pool(5)
    reg.workers["w3"].load = Load(running=50)
    p2 = PowerOfTwo(random.Random(5))
    picks = Counter(route(p2, reg).id for _ in range(2000))
    assert picks["w3"] == 0  # always paired with a lighter one
    assert min(picks[w] for w in ("w0", "w1", "w2", "w4")) > 400  # ties drawn at random
    one = pool(1)
    assert p2.choose(one.ready(Role.PREFILL)).id == "w0"


def test_ties_break_by_id():
    reg = pool(3)
    a, b = PowerOfTwo(random.Random(1)), PrefixAware()
    assert b.choose(reg.ready(Role.PREFILL), [1] * 40).id == "w0"
    chosen = a.choose(reg.ready(Role.PREFILL))
    assert chosen.id in reg.workers


@pytest.mark.parametrize("name", sorted(set(PREFILL_POLICIES) | set(DECODE_POLICIES)))
def test_no_policy_ever_picks_a_dead_or_draining_worker(name):
    reg = pool(6, Role.BOTH)
    reg.mark_dead("w0")
    reg.drain("w3")
    reg.workers["w1"].load = Load(running=9)
    policy = make_policy(name, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    # Teach prefix affinity towards the workers that are about to be unavailable.
    for wid in ("w0", "w3"):
        policy.routed(reg.workers[wid], prompt)
    for side in (Role.PREFILL, Role.DECODE):
        for i in range(200):
            w = route(policy, reg, prompt if i % 2 else [i], side)
            assert w.id not in ("w0", "w3")
    assert policy.choose([], prompt) is None


def test_prefix_affinity_sends_shared_prefixes_to_the_holder():
    reg = pool(3)
    pa = PrefixAware(block_size=4)
    system = list(range(100, 112))  # three full blocks
    first = route(pa, reg, system + [1, 2])
    assert pa.match(system + [9, 9, 9, 9]) == {first.id: 3}
    first.inflight = 2  # busier than the others, within the balance
    for tail in range(10):
        assert route(pa, reg, system + [tail]).id == first.id
    # A prompt sharing nothing goes to the least loaded.
    assert route(pa, reg, [7] * 12).id != first.id


def test_longest_prefix_wins():
    reg = pool(2)
    pa = PrefixAware(block_size=4)
    pa.routed(reg.workers["w0"], [1, 2, 3, 4])
    pa.routed(reg.workers["w1"], [1, 2, 3, 4, 5, 6, 7, 8])
    assert pa.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == {"w1": 2}
    assert pa.choose(reg.ready(Role.PREFILL), [1, 2, 3, 4, 5, 6, 7, 8, 9]).id == "w1"


def test_short_prompts_have_no_affinity():
    reg = pool(2)
    pa = PrefixAware(block_size=16)
    reg.workers["w0"].inflight = 1
    pa.routed(reg.workers["w0"], [1, 2, 3])
    assert pa.match([1, 2, 3]) == {} and pa.choose(reg.ready(Role.PREFILL), [1, 2, 3]).id == "w1"


def test_a_hot_prefix_does_not_overload_its_holder():
    reg = pool(4)
    pa = PrefixAware(block_size=4, balance=4)
    hot = list(range(40))
    for _ in range(200):
        route(pa, reg, hot).inflight += 1  # a flood of the same prefix, nothing finishes
    loads = sorted(w.inflight for w in reg.workers.values())
    assert loads[-1] - loads[0] <= 4 + 1, loads
    assert sum(loads) == 200


def test_prefix_memory_is_bounded():
    reg = pool(1)
    pa = PrefixAware(block_size=1, capacity=10)
    pa.routed(reg.workers["w0"], list(range(25)))
    assert len(pa._owner) == 10
    assert pa.match([0]) == {}  # the oldest were forgotten
    assert pa.match([0, 1, 2]) == {}


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError) as e:
        make_policy("fastest")
    assert "round_robin" in str(e.value) and "prefix_aware" in str(e.value)
    assert "prefix_aware" not in DECODE_POLICIES and "prefix_aware" in PREFILL_POLICIES
    assert make_policy("prefix_aware", block_size=128).block_size == 128
