"""The live page's ring (controller/history.py) from a scripted timeline with fake clocks."""

from __future__ import annotations

import tracemalloc

import pytest

from pdserve.controller import history as hist
from pdserve.controller.history import History, quantile
from pdserve.controller.metrics import Metrics
from pdserve.controller.pool import WorkerLost
from pdserve.controller.registry import Registry
from pdserve.errors import RequestFailed, StepTimeout
from pdserve.protocol import EngineInfo, Load, Register, Role

INFO = EngineInfo("m", "m", 16, "float32", "nixl", 4096)


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def wall():
    return Clock(1_000_000.0)


@pytest.fixture
def mono():
    return Clock(100.0)


@pytest.fixture
def reg(mono):
    return Registry(INFO, clock=mono)


@pytest.fixture
def m(mono, reg):
    metrics = Metrics(clock=mono)
    metrics.watch_pool(reg)
    return metrics


def add(reg: Registry, wid: str, role: Role = Role.DECODE):
    worker, _ = reg.register(Register(wid, role, "h", INFO), wid.encode())
    assert worker is not None
    return worker


def request(m: Metrics, mono: Clock, ttft: float, outcome: str = "completed",
            local: bool = False, handoff: float = 0.0075) -> None:
    t = m.timeline(8)
    if local:
        t.local("d1")
    else:
        t.prefill_started("p1")
    mono.t += ttft
    if not local:
        t.prefill_done(8)
    t.tokens(1)
    if not local:
        mono.t += handoff
        t.decode_started("d1")
        t.tokens(1)
    t.finish(outcome)


def test_quantile_is_prometheus_histogram_quantile():
    bounds = [0.1, 0.2, 0.4, float("inf")]
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None
    # 10 observations in (0.1, 0.2]: the median is halfway through that bucket.
    assert quantile(0.5, bounds, [0, 10, 10, 10]) == pytest.approx(0.15)
    # 4 in the first bucket (from 0), 4 in the second: rank 4 is the first bucket's end.
    assert quantile(0.5, bounds, [4, 8, 8, 8]) == pytest.approx(0.1)
    assert quantile(0.99, bounds, [4, 8, 8, 8]) == pytest.approx(0.1 + 0.1 * 3.92 / 4)
    # In the +Inf bucket: the highest finite bound.
    assert quantile(0.99, bounds, [0, 0, 1, 10]) == 0.4


def test_samples_count_what_changed_and_views_sum_steps(m, mono, wall, reg):
    h = History(m, interval=5, clock=wall)
    add(reg, "d1")
    request(m, mono, ttft=0.125)  # before the first sample: in it
    request(m, mono, ttft=0.125, local=True)
    m.rejected("queue_full")
    wall.t += 5
    first = h.sample()
    assert list(first.figures[:len(hist.COUNTS)]) == [2, 0, 0, 1, 0, 0, 0, 1, 1]
    wall.t += 5
    request(m, mono, ttft=0.35, outcome="failed")
    t = m.timeline(3)
    t.prefill_started("p1")
    t.retried(migrated=False)
    t.retried(migrated=True)
    t.finish("aborted")
    h.sample()
    wall.t += 5
    h.sample()  # nothing happened

    v = h.view(300)
    assert v["step_s"] == 5 and v["t"] == [wall.t - 10, wall.t - 5, wall.t]
    assert v["since"] == wall.t - 15  # the time axis starts when the history began
    c = v["counts"]
    assert c["completed"] == [2, 0, 0] and c["failed"] == [0, 1, 0] and c["aborted"] == [0, 1, 0]
    assert c["refused"] == [1, 0, 0] and c["retried"] == [0, 1, 0] and c["migrated"] == [0, 1, 0]
    assert c["local"] == [1, 0, 0] and c["handoff"] == [1, 1, 0]
    assert v["totals"]["completed"] == 2 and v["totals"]["handoff"] == 2
    # Two first tokens in (0.1, 0.15], then one in (0.3, 0.5]; none in the last step.
    ttft = v["latency"]["ttft"]
    assert ttft["p50"][0] == pytest.approx(0.125) and ttft["p99"][0] == pytest.approx(0.1495)
    assert ttft["p50"][1] == pytest.approx(0.4) and ttft["p50"][2] is None
    assert v["latency"]["handoff"]["p50"][0] == pytest.approx(0.0075)
    assert v["latency_window"]["ttft"]["p50"] == pytest.approx(0.1 + 0.05 * 1.5 / 2)


def test_a_long_window_merges_samples_into_steps(m, mono, wall):
    h = History(m, interval=1, clock=wall)
    for i in range(int(hist.KEEP_S) + 50):
        if i % 10 == 0:
            request(m, mono, ttft=0.05)
        wall.t += 1
        h.sample()
    assert len(h.samples) == 3600  # the ring: one hour
    v = h.view(3600)
    assert v["step_s"] == 12 and len(v["t"]) == 300 and v["since"] == wall.t - 3600
    assert sum(v["counts"]["completed"]) == 360  # each of the hour's requests, once
    assert v["gauges"]["inflight"] == [0] * 300
    short = h.view(300)
    assert short["step_s"] == 1 and len(short["t"]) == 300
    assert sum(short["counts"]["completed"]) == 30


def test_per_worker_gauges_and_membership(m, mono, wall, reg):
    h = History(m, interval=5, clock=wall)
    w1 = add(reg, "d1")
    h.worker_event("registered", w1)
    reg.heartbeat("d1", Load(running=3, waiting=1, kv_usage=0.25), False)
    wall.t += 5
    h.sample()
    wall.t += 1
    w2 = add(reg, "p1", Role.PREFILL)
    h.worker_event("registered", w2)
    h.worker_event("registered", w2)  # the same event again: one mark
    wall.t += 1
    reg.drain("d1")
    h.worker_event("draining", reg.workers["d1"])
    wall.t += 3
    h.sample()
    wall.t += 2
    reg.mark_dead("p1")
    h.worker_event("dead", w2)
    reg.unregister("d1")
    h.worker_event("unregistered", w1)
    wall.t += 3
    h.sample()

    v = h.view(300)
    assert [(mk["worker"], mk["role"], mk["event"], mk["t"]) for mk in v["marks"]] == [
        ("d1", "decode", "joined", wall.t - 15), ("p1", "prefill", "joined", wall.t - 9),
        ("d1", "decode", "draining", wall.t - 8), ("p1", "prefill", "dead", wall.t - 3),
        ("d1", "decode", "left", wall.t - 3)]
    workers = {w["id"]: w for w in v["workers"]}
    assert workers["d1"]["running"] == [3, 3, None] and workers["d1"]["kv_usage"][0] == 0.25
    assert workers["p1"]["role"] == "prefill" and workers["p1"]["running"] == [None, 0, 0]
    assert h.view(5)["marks"] == v["marks"][-2:]


def test_failures_keep_their_reason_and_worker(m, mono, wall, reg):
    add(reg, "d2")
    t = m.timeline(3)
    t.prefill_started("p1")
    try:
        raise WorkerLost("p1", "silent, and its connection is gone")
    except WorkerLost:
        t.retried(migrated=False)  # as the sequence calls it: in its except clause
    t.decode_started("d2")
    try:
        raise RuntimeError("worker d2: KV transfer failed")  # WorkerFailed's shape
    except RuntimeError:
        t.retried(migrated=True)
    try:
        try:
            raise StepTimeout("decode", "d2", 60)
        except StepTimeout as e:
            raise RequestFailed("request r failed on 3 workers; last: timed out") from e
    except RequestFailed:
        t.finish("failed")
    fails = [(f.kind, f.worker, f.reason) for f in m.recent_failures]
    assert fails == [
        ("prefill_retry", "p1", "worker p1 lost: silent, and its connection is gone"),
        ("migration", "d2", "worker d2: KV transfer failed"),
        ("failed", "d2", "request r failed on 3 workers; last: timed out")]
    h = History(m, interval=5, clock=lambda: m.recent_failures[-1].t + 1)
    assert [f["kind"] for f in h.view(300)["failures"]] == ["failed", "migration",
                                                            "prefill_retry"]


def test_the_ring_stays_within_its_memory_bound(m, mono, wall, reg):
    """The bound the module docstring states: under 2.5 KB a sample with MAX_WORKERS workers."""
    for i in range(hist.MAX_WORKERS + 6):  # more than the page keeps
        add(reg, f"w{i:03d}")
        reg.heartbeat(f"w{i:03d}", Load(running=i, waiting=1, kv_usage=i / 100), False)
    h = History(m, interval=1, clock=wall)
    n = 200
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(n):
            wall.t += 1
            h.sample()
        per_sample = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert len(h.samples[-1].workers) == hist.MAX_WORKERS
    assert per_sample < 2500, per_sample
    assert History(m, interval=5).samples.maxlen == 720
    assert h.samples.maxlen == 3600  # at the shortest interval: under 9 MB
    for _ in range(3610 - n):
        wall.t += 1
        h.sample()
    assert len(h.samples) == 3600 and h.samples[0].t == wall.t - 3599


def test_interval_is_bounded(m):
    with pytest.raises(ValueError):
        History(m, interval=0.5)
