"""Per-request placement: local or disaggregated, and where, against the SLO (pure, no engine).

Each flip point is computed here from the profile's own arithmetic, then the placement is
checked just below and just above it."""

from __future__ import annotations

import math
import time

import pytest

from pdserve.planner.costmodel import Profile
from pdserve.planner.placement import Request, Slo, WorkerState, place

P = Profile(prefill_base_s=0.01, prefill_per_token_s=1e-4, step_base_s=0.005,
            step_per_running_s=0.001, step_per_kkv_s=0.0, handoff_s=0.05)
OUT = 101  # 100 gaps after the first token


def pool(queued: int = 0, running: int = 4, kv: int = 4000) -> list[WorkerState]:
    return [WorkerState("p", "prefill", P, queued_prefill_tokens=queued),
            WorkerState("d", "decode", P, running=running, kv_tokens=kv)]


def test_short_prompts_go_local_below_the_handoff_break_even():
    # First token from the prefill: a handoff adds handoff/(out-1) to this stream's TPOT; a
    # local prefill adds its own duration (one chunk riding a decode step) / (out-1) to the
    # streams on the decode worker. TPOT is the binding term, so local wins while
    # a + b*n + step(4) < handoff.
    slo = Slo(ttft_ms=2000, tpot_ms=50)
    n_star = (P.handoff_s - P.prefill_base_s - P.step_seconds(4, 4000)) / P.prefill_per_token_s
    below = place(Request(int(n_star * 0.85), OUT), pool(), slo)
    above = place(Request(int(n_star * 1.15), OUT), pool(), slo)
    assert below is not None and above is not None
    assert (below.kind, below.reason, below.decode_worker) == ("local", "slo_local", "d")
    assert (above.kind, above.reason) == ("disaggregated", "slo_disagg")
    assert (above.prefill_worker, above.decode_worker) == ("p", "d")


def test_a_long_prefill_queue_sends_the_prompt_local():
    # Handoff in TTFT (--first-token decode): disaggregated TTFT = queue + own + handoff, TPOT =
    # step(5); local TTFT = own + a decode step, TPOT = step(5) + own/100. The queue length at
    # which the disaggregated TTFT slack falls under the local option's slack:
    slo = Slo(ttft_ms=2000, tpot_ms=50)
    n = 100
    own_local = P.prefill_seconds(n) + P.step_seconds(4, 4000)
    step5 = P.step_seconds(5, 4000 + n + OUT // 2)
    slack_local = min(1 - own_local / 2.0, 1 - (step5 + own_local / 100) / 0.05)
    # 1 - (a + b*Q + prefill(n) + handoff) / 2.0 == slack_local
    q_star = ((1 - slack_local) * 2.0 - P.prefill_base_s - P.prefill_seconds(n)
              - P.handoff_s) / P.prefill_per_token_s
    assert q_star > 1000
    short = place(Request(n, OUT), pool(queued=int(q_star * 0.9)), slo, handoff_in_ttft=True)
    long = place(Request(n, OUT), pool(queued=int(q_star * 1.1)), slo, handoff_in_ttft=True)
    assert short is not None and long is not None
    assert short.kind == "disaggregated"
    assert long.kind == "local" and long.reason == "slo_local"
    assert long.predicted_ttft < 2.0 * (1 - slack_local) < short.predicted_ttft + 0.2


def test_streams_on_the_decode_worker_make_a_prefill_go_elsewhere():
    slo = Slo(ttft_ms=2000, tpot_ms=50)
    idle = place(Request(1500, OUT), pool(running=0, kv=0), slo, handoff_in_ttft=True)
    busy = place(Request(1500, OUT), pool(running=3, kv=3000), slo, handoff_in_ttft=True)
    assert idle is not None and busy is not None
    assert idle.kind == "local"  # nobody to stall, and no handoff in its TTFT
    assert busy.kind == "disaggregated"  # its prefill would stall three streams ~0.17 s
    assert busy.predicted_tpot == P.step_seconds(4, 3000 + 1500 + OUT // 2)


def test_a_bound_on_the_stall_keeps_a_long_prefill_off_a_decoding_worker():
    # A long answer spreads a local prefill's stall thin in TPOT, and a costly handoff makes
    # local the SLO's choice; the streams on the worker would still pause ~0.17 s each.
    costly = Profile(prefill_base_s=0.01, prefill_per_token_s=1e-4, step_base_s=0.005,
                     step_per_running_s=0.001, handoff_s=1.0)
    workers = [WorkerState("p", "prefill", costly), WorkerState("d", "decode", costly, running=3)]
    slo, req = Slo(ttft_ms=2000, tpot_ms=50), Request(1500, 1001)
    free = place(req, workers, slo)
    bound = place(req, workers, slo, max_stall_s=0.1)
    assert free is not None and bound is not None
    assert (free.kind, free.reason) == ("local", "slo_local")
    assert free.stall_s == pytest.approx(costly.prefill_seconds(1500) + costly.step_seconds(3, 0))
    assert (bound.kind, bound.reason, bound.stall_s) == ("disaggregated", "slo_disagg", 0.0)
    # An idle decode worker too: a stream handed to it during the prefill would wait for it.
    idle = [WorkerState("p", "prefill", costly), WorkerState("d", "decode", costly)]
    unbound, bound_idle = place(req, idle, slo), place(req, idle, slo, max_stall_s=0.1)
    assert unbound is not None and bound_idle is not None
    assert (unbound.kind, bound_idle.kind) == ("local", "disaggregated")
    # A handoff's own pause: local prefills queued on its decode worker.
    queued = [WorkerState("p", "prefill", costly),
              WorkerState("d", "decode", costly, queued_prefill_tokens=3000)]
    behind = place(Request(50, 1001), queued, slo, max_stall_s=0.1)
    assert behind is not None and behind.stall_s >= costly.prefill_seconds(3000)
    # A short prompt's stall is under the bound: local still.
    short = place(Request(100, 1001), workers, slo, max_stall_s=0.1)
    assert short is not None and short.kind == "local" and 0 < short.stall_s < 0.1
    # When every option would stall (one worker, both duties), the bound cannot be kept.
    alone = place(req, [WorkerState("b", "both", costly, running=3)], slo, max_stall_s=0.1)
    assert alone is not None and alone.kind == "local"


def test_least_violation_when_nothing_meets_the_slo():
    slo = Slo(ttft_ms=1, tpot_ms=1)
    got = place(Request(1000, OUT), pool(), slo)
    assert got is not None and got.reason == "least_violation"
    local = place(Request(1000, OUT), pool(), slo, local_prefill_threshold=10**9)
    disagg = place(Request(1000, OUT), pool(), slo, local_prefill_threshold=0)
    assert local is not None and disagg is not None
    least = min((local, disagg), key=lambda o: slo.violation(o.predicted_ttft,
                                                             o.predicted_tpot))
    assert got.kind == least.kind


def test_the_manual_threshold_wins_over_the_slo():
    slo = Slo(ttft_ms=2000, tpot_ms=50)
    assert place(Request(250, OUT), pool(), slo).kind == "local"  # type: ignore[union-attr]
    forced = place(Request(250, OUT), pool(), slo, local_prefill_threshold=100)
    assert forced is not None
    assert (forced.kind, forced.reason) == ("disaggregated", "manual_threshold")
    assert place(Request(370, OUT), pool(), slo).kind == "disaggregated"  # type: ignore
    kept = place(Request(370, OUT), pool(), slo, local_prefill_threshold=1000)
    assert kept is not None and (kept.kind, kept.reason) == ("local", "manual_threshold")


def test_the_prefill_goes_to_the_worker_that_holds_the_prefix():
    workers = [WorkerState("p1", "prefill", P), WorkerState("p2", "prefill", P),
               WorkerState("d", "decode", P, running=4, kv_tokens=4000)]
    slo = Slo(ttft_ms=2000, tpot_ms=50)
    got = place(Request(2000, OUT, uncached={"p2": 100}), workers, slo, handoff_in_ttft=True)
    assert got is not None and (got.kind, got.prefill_worker) == ("disaggregated", "p2")
    assert math.isclose(got.predicted_ttft, P.prefill_seconds(100) + P.handoff_s)


def test_without_a_decode_worker_there_is_no_placement_and_both_serves_alone():
    slo = Slo(ttft_ms=2000, tpot_ms=50)
    assert place(Request(100, OUT), [WorkerState("p", "prefill", P)], slo) is None
    alone = place(Request(100, OUT), [WorkerState("b", "both", P)], slo)
    assert alone is not None and (alone.kind, alone.decode_worker) == ("local", "b")


def test_a_decision_over_512_workers_is_quick():
    workers = [WorkerState(f"w{i}", "prefill" if i < 128 else "decode", P,
                           queued_prefill_tokens=(i * 37) % 3000, running=(i * 7) % 20,
                           kv_tokens=(i * 7) % 20 * 600) for i in range(512)]
    t0 = time.perf_counter()
    got = place(Request(1000, OUT), workers, Slo(ttft_ms=2000, tpot_ms=50))
    assert time.perf_counter() - t0 < 0.5
    assert got is not None
    # The chosen prefill worker has the shortest queue among the prefill workers.
    queues = {w.id: w.queued_prefill_tokens for w in workers if w.role == "prefill"}
    if got.kind == "disaggregated":
        assert queues[got.prefill_worker] == min(queues.values())
