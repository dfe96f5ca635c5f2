"""End-to-end request metrics, measured at the controller (what the client sees).

Each request gets a `Timeline`; the request code reports events to it (queued, prefill started
and done, tokens, decode started, retries) and the timeline turns them into Prometheus
observations with an injectable clock, so the definitions are tested without real time.

TTFT is from the controller receiving the request to its first token leaving, whichever worker
produced it; prompt tokens are counted once per request, never per engine.
"""

from __future__ import annotations

import bisect
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pdserve.controller.registry import Registry, WorkerState

if TYPE_CHECKING:
    from pdserve.controller.planning import Planning

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0, 20.0, 40.0, 80.0)
_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
          0.5, 0.75, 1.0, 2.5, 5.0)
_BYTES = tuple(float(4 ** k * 1024) for k in range(12))  # 1 KiB to 4 GiB
RECENT = 2000  # requests kept for the dashboard's percentiles
RECENT_FAILURES = 100  # failures kept for the dashboard's list


class Failure(NamedTuple):
    """A leg retried or migrated, or a request failed: for the live page's list."""

    t: float  # wall clock
    kind: str  # prefill_retry, migration or failed (the request)
    worker: str  # the worker the error names, else the one the request was last sent to
    reason: str


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Request arrival at the controller to its first output token",
                              buckets=_LATENCY, registry=r)
        # Observed per token: kept by the event loop without prometheus_client's locks.
        self.itl = LoopHistogram("pdserve_inter_token_latency_seconds",
                                 "Gap between consecutive output tokens, as streamed by the "
                                 "controller", _TOKEN)
        self.generation_tokens = LoopCounter("pdserve_generation_tokens",
                                             "Output tokens streamed to clients")
        r.register(_LoopCollector((self.itl, self.generation_tokens)))
        self.tpot = Histogram("pdserve_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (output tokens - 1)",
                              buckets=_TOKEN, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds",
                             "Request arrival to its end (any outcome)", buckets=_LATENCY,
                             registry=r)
        self.queue = Histogram("pdserve_queue_time_seconds",
                               "Request arrival to a worker being chosen for it",
                               buckets=_LATENCY, registry=r)
        self.prefill = Histogram("pdserve_prefill_time_seconds",
                                 "Prefill sent to a prefill worker to its result back",
                                 buckets=_LATENCY, registry=r)
        self.handoff = Histogram("pdserve_kv_handoff_seconds",
                                 "Prefill done to the decode worker's first new token "
                                 "(KV pull + first decode step)", buckets=_LATENCY, registry=r)
        self.requests = Counter("pdserve_requests", "Finished requests by outcome "
                                "(completed, aborted, failed, rejected)", ["outcome"], registry=r)
        self.recovered = Counter("pdserve_requests_recovered",
                                 "Requests that completed after a retry or migration", registry=r)
        self.retries = Counter("pdserve_retries", "Failed legs retried: prefill_retry before any "
                               "token, migration after some", ["kind"], registry=r)
        self.local = Counter("pdserve_local_prefills",
                             "Sequences prefilled on the worker that decodes them (no handoff)", registry=r)
        self.routes = Counter("pdserve_routes", "Completed sequences by path (local, "
                              "disaggregated) and why local: short (little to compute), cached "
                              "(the decode worker held most of it: a handoff skipped), auto, "
                              "no_prefill_worker or no_decode_worker (none of that role in the "
                              "pool: one of the other served it whole)",
                              ["path", "reason"], registry=r)
        self.cached_tokens = Counter("pdserve_prefix_cached_tokens", "Prompt tokens the "
                                     "engines had in their prefix caches, as they reported, by "
                                     "side (prefill, decode)", ["side"], registry=r)
        self.computed_tokens = Counter("pdserve_prompt_tokens_computed", "Prompt tokens the "
                                       "engines computed (not in their prefix caches, not "
                                       "read), by side", ["side"], registry=r)
        self.kv_read_tokens = Counter("pdserve_kv_read_tokens", "Prompt tokens whose KV decode "
                                      "workers read from prefill workers", registry=r)
        self.kv_reads = Counter("pdserve_kv_reads", "KV reads by decode workers, by where "
                                "the engine did them: in_step (inside the step computing the "
                                "next token) or own_step (steps of their own)",
                                ["mode"], registry=r)
        for mode in ("in_step", "own_step"):
            self.kv_reads.labels(mode)  # both series from the start, at 0
        self.handoff_phase = Histogram("pdserve_handoff_phase_seconds", "The KV handoff by "
                                       "phase: controller, transit (both hops), worker_in, "
                                       "schedule, kv_read, first_step, worker_out "
                                       "(controller/phases.py)",
                                       ["phase"], buckets=_TOKEN, registry=r)
        self.kv_bytes = Histogram("pdserve_kv_transfer_bytes", "KV bytes a decode worker read "
                                  "from a prefill worker, per disaggregated sequence",
                                  buckets=_BYTES, registry=r)
        self.no_worker = Counter("pdserve_no_worker_rejections",
                                 "Requests refused with 503 for lack of a worker", ["role"],
                                 registry=r)
        self.admission_rejections = Counter(
            "pdserve_admission_rejections", "Requests refused by admission control: queue_full "
            "and expected_wait (429), queue_timeout (503)", ["reason"], registry=r)
        # Read from the controller's Admission at scrape time (watch_admission).
        self.inflight = Gauge("pdserve_inflight_sequences", "Sequences running (a request with "
                              "n > 1 counts n)", registry=r)
        self.queued = Gauge("pdserve_queued_sequences", "Sequences waiting for an admission slot",
                            registry=r)
        self.limit = Gauge("pdserve_admission_limit", "Sequences that may run at once: "
                           "--max-inflight, or the ready decode workers' slots when fewer (less those "
                           "other controllers hold)",
                           registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of requests "
                                     "(counted once per request)", registry=r)
        # Recent finished requests for the dashboard: (end time, outcome, ttft, tpot, e2e).
        self.recent: deque[tuple[float, str, float | None, float | None, float]] = deque(
            maxlen=RECENT)
        self.recent_failures: deque[Failure] = deque(maxlen=RECENT_FAILURES)
        self.pool: Registry | None = None  # set by watch_pool: names failures' workers
        self.role_changes = Counter("pdserve_role_changes", "Duty changes of auto workers by "
                                    "the role planner, by why", ["why"], registry=r)
        self.planning: Planning | None = None  # set by watch_planning: fed the load it sees

    def timeline(self, prompt_tokens: int) -> Timeline:
        self.prompt_tokens.inc(prompt_tokens)
        if self.planning is not None:
            self.planning.arrived(prompt_tokens)
        return Timeline(self)

    def watch_planning(self, planning: Planning) -> None:
        """Feed `planning` the load this controller sees; count its changes; export its desired
        workers per role at scrape time."""
        self.planning = planning
        planning.on_change = lambda w, old, new, why: self.role_changes.labels(why).inc()
        self.registry.register(_PlanningCollector(planning))

    def rejected_no_worker(self, role: str) -> None:
        self.no_worker.labels(role).inc()

    def rejected(self, reason: str) -> None:
        self.admission_rejections.labels(reason).inc()

    def watch_admission(self, admission) -> None:
        self.inflight.set_function(lambda: admission.inflight)
        self.queued.set_function(lambda: admission.queued)
        self.limit.set_function(admission.limit)

    def watch_pool(self, registry) -> None:
        """Export per-worker gauges from the pool registry at scrape time."""
        self.pool = registry
        self.registry.register(_PoolCollector(registry))

    def failed(self, kind: str, error: BaseException | None, last_worker: str | None) -> None:
        reason = "" if error is None else (str(error) or type(error).__name__)
        worker = self._culprit(error) or last_worker or ""
        self.recent_failures.append(Failure(time.time(), kind, worker, reason[:300]))

    def _culprit(self, error: BaseException | None) -> str | None:
        """The worker an error names: its `worker_id` (WorkerLost, StepTimeout) or its cause's,
        else a registered worker's id after the word "worker" in its message (WorkerFailed)."""
        e = error
        while e is not None:
            wid = getattr(e, "worker_id", None)
            if isinstance(wid, str):
                return wid
            e = e.__cause__
        known = self.pool.workers if self.pool is not None else {}
        return next((w for w in re.findall(r"\bworker ([^\s:]+)", str(error or ""))
                     if w in known), None)


class Timeline:
    """One request's events, with the observations they imply."""

    def __init__(self, m: Metrics):
        self.m = m
        self.start = m.clock()
        self.first: float | None = None
        self.last: float | None = None
        self.n_tokens = 0
        self.chosen = False
        self.prefill_start: float | None = None
        self.prefill_end: float | None = None
        self.prefill_alone = False
        self.awaiting_decode = False
        self.failures = 0
        self.finished = False
        self.worker: str | None = None  # the worker last given a leg of this request

    def queued(self) -> None:
        pass  # the request is waiting for a worker choice since `start` or its last failure

    def _chosen(self) -> None:
        if not self.chosen:
            self.chosen = True
            self.m.queue.observe(self.m.clock() - self.start)

    def prefill_started(self, worker_id: str, alone: bool = False) -> None:
        """`alone`: nothing ahead of it on the worker, so its time is the engine's own (the
        role planner's cost model learns from those only: a queue's time would read as a slow
        engine, and the planner would move workers away from a prefill side that is merely
        busy)."""
        self._chosen()
        self.worker = worker_id
        self.prefill_start = self.m.clock()
        self.prefill_alone = alone

    def prefill_done(self, n_tokens: int) -> None:
        now = self.m.clock()
        if self.prefill_start is not None:
            self.m.prefill.observe(now - self.prefill_start)
            if self.m.planning is not None and self.worker is not None and self.prefill_alone:
                self.m.planning.prefilled(self.worker, n_tokens, now - self.prefill_start)
        self.prefill_end = now
        self.awaiting_decode = True

    def local(self, worker_id: str) -> None:
        self._chosen()
        self.worker = worker_id
        self.awaiting_decode = False  # a prefill gone on from where it ran: no KV handoff
        self.m.local.inc()

    def decode_started(self, worker_id: str) -> None:
        self.worker = worker_id
        if self.awaiting_decode and self.prefill_end is not None:
            self.m.handoff.observe(self.m.clock() - self.prefill_end)
            if self.m.planning is not None:
                self.m.planning.handed_over(worker_id, self.m.clock() - self.prefill_end)
        self.awaiting_decode = False

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = self.m.clock()
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.start)
            gaps = n - 1
        else:
            gaps = n
        if gaps and self.last is not None:
            # A burst of n tokens in one message: spread the gap as vLLM's benchmark does.
            for _ in range(gaps):
                self.m.itl.observe((now - self.last) / gaps)
        self.last = now
        self.n_tokens += n
        self.m.generation_tokens.inc(n)

    def routed(self, route) -> None:
        """A completed sequence's route receipt (receipts.Route)."""
        m = self.m
        m.routes.labels(route.path, route.reason or "-").inc()
        if route.prefill_hit is not None:
            m.cached_tokens.labels("prefill").inc(route.prefill_hit)
            m.computed_tokens.labels("prefill").inc(max(0, route.tokens - route.prefill_hit))
        if route.decode_hit is not None:
            m.cached_tokens.labels("decode").inc(route.decode_hit)
            if route.path == "local":
                m.computed_tokens.labels("decode").inc(max(0, route.tokens - route.decode_hit))
        if route.kv_read_tokens is not None:
            m.kv_read_tokens.inc(route.kv_read_tokens)
        if route.kv_read_in_step is not None:
            m.kv_reads.labels("in_step" if route.kv_read_in_step else "own_step").inc()
        if route.kv_bytes is not None:
            m.kv_bytes.observe(route.kv_bytes)

    def handoff_phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.m.handoff_phase.labels(phase).observe(seconds)

    def retried(self, migrated: bool, error: BaseException | None = None) -> None:
        """A leg failed and the sequence goes on elsewhere. The sequence calls this in its
        `except` clause: `error` defaults to the exception being handled there."""
        self.failures += 1
        kind = "migration" if migrated else "prefill_retry"
        self.m.retries.labels(kind).inc()
        self.m.failed(kind, error if error is not None else sys.exception(), self.worker)

    def finish(self, outcome: str) -> None:
        if self.finished:
            return
        self.finished = True
        now = self.m.clock()
        e2e = now - self.start
        self.m.e2e.observe(e2e)
        self.m.requests.labels(outcome).inc()
        if outcome == "completed" and self.failures:
            self.m.recovered.inc()
        if outcome == "failed":  # called as the request's error propagates: it is the reason
            self.m.failed("failed", sys.exception(), self.worker)
        tpot = None
        if self.first is not None and self.last is not None and self.n_tokens > 1:
            tpot = (self.last - self.first) / (self.n_tokens - 1)
            self.m.tpot.observe(tpot)
        ttft = None if self.first is None else self.first - self.start
        self.m.recent.append((time.time(), outcome, ttft, tpot, e2e))
        if self.m.planning is not None and outcome == "completed":
            self.m.planning.finished(self.n_tokens)


class LoopHistogram:
    """A histogram for observations made on the event loop only, once per streamed token:
    no lock and no label lookup (prometheus_client's Histogram costs ~2 us an observation);
    exported at scrape time as an ordinary Prometheus histogram."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.bounds = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        cumulative, acc = [], 0
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            acc += n
            cumulative.append((bound, acc))
        return HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=self.sum)


class LoopCounter:
    """A counter incremented on the event loop only (see LoopHistogram)."""

    def __init__(self, name: str, doc: str):
        self.name, self.doc, self.value = name, doc, 0

    def inc(self, n: int = 1) -> None:
        self.value += n

    def family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.doc, value=self.value)


class _LoopCollector:
    def __init__(self, metrics: tuple[LoopHistogram | LoopCounter, ...]):
        self.metrics = metrics

    def collect(self):
        for m in self.metrics:
            yield m.family()


class _PlanningCollector:
    def __init__(self, planning: Planning):
        self.planning = planning

    def collect(self):
        desired = GaugeMetricFamily("pdserve_planner_desired_workers", "Workers of each role "
                                    "the role planner's model says the demand it sees needs "
                                    "(the autoscaling signal)", labels=["role"])
        for role, n in self.planning.desired.items():
            desired.add_metric([role], n)
        yield desired


class _PoolCollector:
    def __init__(self, registry: Registry):
        self.registry = registry

    def collect(self):
        running = GaugeMetricFamily("pdserve_worker_running_requests",
                                    "Running requests reported by the worker's engine",
                                    labels=["worker", "role"])
        waiting = GaugeMetricFamily("pdserve_worker_waiting_requests",
                                    "Waiting requests reported by the worker's engine",
                                    labels=["worker", "role"])
        kv = GaugeMetricFamily("pdserve_worker_kv_usage_ratio",
                               "Fraction of the worker's KV cache in use",
                               labels=["worker", "role"])
        inflight = GaugeMetricFamily("pdserve_worker_inflight_requests",
                                     "This controller's request legs on the worker",
                                     labels=["worker", "role"])
        age = GaugeMetricFamily("pdserve_worker_heartbeat_age_seconds",
                                "Seconds since the worker was last heard from (a heartbeat, an "
                                "output or any other message)", labels=["worker", "role"])
        workers = GaugeMetricFamily("pdserve_pool_workers", "Workers by role and state",
                                    labels=["role", "state"])
        suspicions = CounterMetricFamily(
            "pdserve_worker_suspicions", "Suspicions of silent workers, by how they ended: "
            "cleared (the worker spoke again: a false suspicion) or dead", labels=["outcome"])
        now = self.registry.clock()
        for w in self.registry.workers.values():
            labels = [w.id, w.role.label]
            running.add_metric(labels, w.load.running)
            waiting.add_metric(labels, w.load.waiting)
            kv.add_metric(labels, w.load.kv_usage)
            inflight.add_metric(labels, w.inflight)
            age.add_metric(labels, now - w.last_seen)
        counts = self.registry.counts()
        for role in sorted({role for role, _ in counts}):
            for state in WorkerState:  # zeros too, so that "suspect > 0" has a series to watch
                workers.add_metric([role, state.value], counts.get((role, state.value), 0))
        for outcome, n in self.registry.suspicions.items():
            suspicions.add_metric([outcome], n)
        yield from (running, waiting, kv, inflight, age, workers, suspicions)
