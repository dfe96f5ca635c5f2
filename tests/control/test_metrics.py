"""Request metrics from a scripted timeline with a fake clock."""

from __future__ import annotations

import pytest

from pdserve.controller.metrics import Metrics
from pdserve.controller.registry import Registry
from pdserve.protocol import EngineInfo, Load, Register, Role


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def m(clock):
    return Metrics(clock=clock)


def value(m: Metrics, name: str, labels: dict | None = None) -> float:
    v = m.registry.get_sample_value(name, labels or {})
    return 0.0 if v is None else v


def hist(m: Metrics, name: str) -> tuple[float, float]:
    return value(m, f"{name}_count"), value(m, f"{name}_sum")


def test_disaggregated_request_timeline(m, clock):
    t = m.timeline(prompt_tokens=40)
    clock.t += 0.5
    t.queued()
    t.prefill_started("p1")  # queue time 0.5
    clock.t += 1.0
    t.prefill_done(40)  # prefill time 1.0
    clock.t += 0.1
    t.tokens(1)  # first token (from the prefill) at 1.6 s
    clock.t += 0.4
    t.decode_started("d1")  # handoff: prefill done -> decode's first new token = 0.5
    t.tokens(1)  # gap 0.4
    clock.t += 0.4
    t.tokens(2)  # two tokens in one message: two gaps of 0.2
    clock.t += 0.1
    t.finish("completed")  # e2e 2.5

    assert hist(m, "pdserve_queue_time_seconds") == (1, pytest.approx(0.5))
    assert hist(m, "pdserve_prefill_time_seconds") == (1, pytest.approx(1.0))
    assert hist(m, "pdserve_time_to_first_token_seconds") == (1, pytest.approx(1.6))
    assert hist(m, "pdserve_kv_handoff_seconds") == (1, pytest.approx(0.5))
    assert hist(m, "pdserve_inter_token_latency_seconds") == (3, pytest.approx(0.8))
    itl_bucket = "pdserve_inter_token_latency_seconds_bucket"
    assert value(m, itl_bucket, {"le": "0.15"}) == 0  # the gaps: 0.2, 0.2 and 0.4
    assert value(m, itl_bucket, {"le": "0.3"}) == 2 and value(m, itl_bucket, {"le": "0.5"}) == 3
    assert hist(m, "pdserve_time_per_output_token_seconds") == (1, pytest.approx(0.8 / 3))
    assert hist(m, "pdserve_e2e_request_latency_seconds") == (1, pytest.approx(2.5))
    assert value(m, "pdserve_requests_total", {"outcome": "completed"}) == 1
    assert value(m, "pdserve_prompt_tokens_total") == 40
    assert value(m, "pdserve_generation_tokens_total") == 4
    assert value(m, "pdserve_requests_recovered_total") == 0
    _, outcome, ttft, _, e2e = m.recent[-1]
    assert (outcome, ttft, e2e) == ("completed", pytest.approx(1.6), pytest.approx(2.5))


def test_a_burst_as_first_output_counts_its_inner_gaps_only_after_a_token(m, clock):
    t = m.timeline(5)
    clock.t += 1.0
    t.tokens(3)  # first output carries 3 tokens: TTFT, no gap before it
    t.finish("completed")
    assert hist(m, "pdserve_time_to_first_token_seconds") == (1, pytest.approx(1.0))
    assert hist(m, "pdserve_inter_token_latency_seconds")[0] == 0
    assert hist(m, "pdserve_time_per_output_token_seconds") == (1, 0.0)
    t.tokens(0)  # nothing new: nothing observed
    assert value(m, "pdserve_generation_tokens_total") == 3


def test_migration_then_completion_counts_as_recovered(m, clock):
    t = m.timeline(10)
    t.prefill_started("p1")
    clock.t += 0.2
    t.prefill_done(10)
    t.tokens(1)
    t.retried(migrated=False)
    t.retried(migrated=True)
    t.prefill_started("p2")  # queue time is observed once per request
    clock.t += 0.3
    t.prefill_done(11)
    t.finish("completed")
    assert value(m, "pdserve_retries_total", {"kind": "prefill_retry"}) == 1
    assert value(m, "pdserve_retries_total", {"kind": "migration"}) == 1
    assert value(m, "pdserve_requests_recovered_total") == 1
    assert hist(m, "pdserve_queue_time_seconds")[0] == 1
    assert hist(m, "pdserve_prefill_time_seconds") == (2, pytest.approx(0.5))


@pytest.mark.parametrize("outcome", ["aborted", "failed", "rejected"])
def test_other_outcomes(m, clock, outcome):
    t = m.timeline(3)
    clock.t += 2.0
    t.retried(migrated=False)
    t.finish(outcome)
    t.finish("completed")  # a second finish is ignored
    assert value(m, "pdserve_requests_total", {"outcome": outcome}) == 1
    assert value(m, "pdserve_requests_total", {"outcome": "completed"}) == 0
    assert value(m, "pdserve_requests_recovered_total") == 0
    assert hist(m, "pdserve_e2e_request_latency_seconds") == (1, pytest.approx(2.0))
    assert hist(m, "pdserve_time_to_first_token_seconds")[0] == 0
    assert m.recent[-1][2] is None  # no TTFT


def test_local_prefill_and_rejections(m, clock):
    t = m.timeline(3)
    clock.t += 0.25
    t.local("d1")
    t.tokens(1)
    t.finish("completed")
    m.rejected_no_worker("prefill")
    m.rejected_no_worker("prefill")
    assert value(m, "pdserve_local_prefills_total") == 1
    assert hist(m, "pdserve_queue_time_seconds") == (1, pytest.approx(0.25))
    assert hist(m, "pdserve_kv_handoff_seconds")[0] == 0  # no handoff happened
    assert value(m, "pdserve_no_worker_rejections_total", {"role": "prefill"}) == 2


def test_pool_gauges_follow_the_registry(m, clock):
    info = EngineInfo("m", "m", 16, "float32", "nixl", 4096)
    reg = Registry(info, clock=clock)
    m.watch_pool(reg)
    reg.register(Register("p1", Role.PREFILL, "h", info), b"p1")
    reg.register(Register("d1", Role.DECODE, "h", info), b"d1")
    reg.heartbeat("d1", Load(3, 2, 0.5), False)
    reg.workers["d1"].inflight = 4
    reg.drain("p1")
    clock.t += 1.5
    labels = {"worker": "d1", "role": "decode"}
    assert value(m, "pdserve_worker_running_requests", labels) == 3
    assert value(m, "pdserve_worker_waiting_requests", labels) == 2
    assert value(m, "pdserve_worker_kv_usage_ratio", labels) == 0.5
    assert value(m, "pdserve_worker_inflight_requests", labels) == 4
    assert value(m, "pdserve_worker_heartbeat_age_seconds", labels) == pytest.approx(1.5)
    assert value(m, "pdserve_pool_workers", {"role": "prefill", "state": "draining"}) == 1
    assert value(m, "pdserve_pool_workers", {"role": "decode", "state": "ready"}) == 1
    reg.unregister("d1")
    assert m.registry.get_sample_value("pdserve_worker_running_requests", labels) is None


def test_suspicions_are_counted_by_outcome_and_suspects_by_state(m, clock):
    info = EngineInfo("m", "m", 16, "float32", "nixl", 4096)
    reg = Registry(info, heartbeat_interval=1.0, missed=3, clock=clock)
    m.watch_pool(reg)
    for wid in ("d1", "d2"):
        reg.register(Register(wid, Role.DECODE, "h", info), wid.encode())
    state = {"role": "decode", "state": "suspect"}
    assert m.registry.get_sample_value("pdserve_pool_workers", state) == 0  # a series to watch
    clock.t += 3.5
    reg.expire()
    assert value(m, "pdserve_pool_workers", state) == 2
    reg.heard("d1")  # a false suspicion
    reg.mark_dead("d2")  # its connection was gone
    assert value(m, "pdserve_pool_workers", state) == 0
    assert value(m, "pdserve_pool_workers", {"role": "decode", "state": "dead"}) == 1
    assert value(m, "pdserve_worker_suspicions_total", {"outcome": "cleared"}) == 1
    assert value(m, "pdserve_worker_suspicions_total", {"outcome": "dead"}) == 1


def test_loop_histogram_exports_what_prometheus_histogram_would():
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client.exposition import generate_latest

    from pdserve.controller.metrics import LoopHistogram, _LoopCollector

    bounds = (0.001, 0.01, 0.1)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = LoopHistogram("x_seconds", "doc", bounds)
    ours.register(_LoopCollector((h,)))
    ref = Histogram("x_seconds", "doc", buckets=bounds, registry=theirs)
    for v in (0.0005, 0.001, 0.002, 0.01, 0.05, 0.1, 0.5, 7.0):  # on the bounds too
        h.observe(v)
        ref.observe(v)

    def lines(reg):
        return sorted(ln for ln in generate_latest(reg).decode().splitlines()
                      if ln.startswith("x_seconds") and "_created" not in ln)

    assert lines(ours) == lines(theirs)
    assert ours.get_sample_value("x_seconds_bucket", {"le": "0.01"}) == 4
