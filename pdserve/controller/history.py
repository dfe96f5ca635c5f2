"""The live page's memory (GET /pd/history): the controller's figures over the last hour in a
ring of fixed size, and the pool's membership changes as they happened.

Every `interval` seconds (5 by default) `sample()` reads the controller's own metrics registry,
the figures /metrics serves, and keeps what changed since the sample before: requests by
outcome, retries and migrations, refusals, local prefills and KV handoffs, and the bucket counts
of the TTFT, inter-token and handoff histograms; with the gauges as they are (sequences in
flight and waiting for admission; per worker: running, waiting, KV usage, in flight).
Membership changes (joined, draining, suspect, cleared, dead, left) come from the pool's hook
(`worker_event`) when they happen; failures, with their reason and worker, from the metrics
(`Metrics.recent_failures`).

`view(window)` turns the samples of a window into at most MAX_POINTS points: counts summed per
step, and p50 / p99 per step interpolated in the summed buckets as Prometheus'
histogram_quantile does, so the page and a Grafana panel over the same series agree.

Memory: one hour of samples, 3600 / interval of them (720 at the default 5 s, 3600 at the
shortest interval, 1 s). A sample is three arrays of numbers: 8 bytes for each of its 71 fixed
figures and 16 bytes per worker, for at most MAX_WORKERS workers (the page leaves out the rest;
Grafana shows every worker). That is under 2.5 KB a sample with 64 workers (measured in
tests/control/test_history.py), so under 1.8 MB for the ring at 5 s and under 9 MB at 1 s;
marks and failures are deques of at most MAX_MARKS and RECENT_FAILURES entries.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from pdserve.controller.metrics import Metrics
from pdserve.controller.registry import Worker

logger = logging.getLogger(__name__)

# Counters charted as counts per step: (key, series, labels a sample must carry; {}: all summed).
COUNTS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("completed", "pdserve_requests_total", {"outcome": "completed"}),
    ("failed", "pdserve_requests_total", {"outcome": "failed"}),
    ("aborted", "pdserve_requests_total", {"outcome": "aborted"}),
    ("refused", "pdserve_admission_rejections_total", {}),
    ("no_worker", "pdserve_no_worker_rejections_total", {}),
    ("retried", "pdserve_retries_total", {"kind": "prefill_retry"}),
    ("migrated", "pdserve_retries_total", {"kind": "migration"}),
    ("local", "pdserve_local_prefills_total", {}),
    ("handoff", "pdserve_kv_handoff_seconds_count", {}),
)
GAUGES: tuple[tuple[str, str], ...] = (
    ("inflight", "pdserve_inflight_sequences"),
    ("queued", "pdserve_queued_sequences"),
)
HISTOGRAMS: tuple[tuple[str, str], ...] = (
    ("ttft", "pdserve_time_to_first_token_seconds"),
    ("itl", "pdserve_inter_token_latency_seconds"),
    ("handoff", "pdserve_kv_handoff_seconds"),
)
WORKER_GAUGES: tuple[tuple[str, str], ...] = (
    ("running", "pdserve_worker_running_requests"),
    ("waiting", "pdserve_worker_waiting_requests"),
    ("kv_usage", "pdserve_worker_kv_usage_ratio"),
    ("inflight", "pdserve_worker_inflight_requests"),
)
QUANTILES = (0.5, 0.99)
MAX_WORKERS = 64  # per sample, by id
MAX_POINTS = 300  # per series in a view
MAX_MARKS = 1000
KEEP_S = 3600.0
# The pool's hook names -> the page's.
EVENTS = {"registered": "joined", "draining": "draining", "suspect": "suspect",
          "stalled": "stalled", "cleared": "cleared", "dead": "dead", "unregistered": "left"}


@dataclass(slots=True)
class Sample:
    t: float  # wall clock
    figures: array[float]  # COUNTS: change since the sample before; then GAUGES: as they are
    buckets: array[float]  # HISTOGRAMS in turn: change of each cumulative bucket count
    workers: tuple[tuple[str, str], ...]  # (id, role), by id; one tuple while they stay
    loads: array[float]  # WORKER_GAUGES of each worker in turn


class Mark(NamedTuple):
    t: float
    worker: str
    role: str
    event: str  # a value of EVENTS


class _Reading(NamedTuple):
    counts: list[float]
    gauges: list[float]
    buckets: dict[str, list[float]]  # cumulative, by bound
    bounds: dict[str, list[float]]  # upper bounds, the last +Inf
    workers: dict[tuple[str, str], list[float]]


def quantile(q: float, bounds: Sequence[float], cumulative: Sequence[float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts (upper `bounds`, the last
    +Inf): linear within the bucket the rank falls in, the highest finite bound when that is
    +Inf; None without observations."""
    total = cumulative[-1] if cumulative else 0.0
    if total <= 0:
        return None
    rank = q * total
    b = next((i for i, c in enumerate(cumulative[:-1]) if c >= rank), len(cumulative) - 1)
    if b == len(bounds) - 1:
        return bounds[-2] if len(bounds) > 1 else None
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, count = 0.0, cumulative[b]
    if b > 0:
        start, count, rank = bounds[b - 1], count - cumulative[b - 1], rank - cumulative[b - 1]
    return start + (bounds[b] - start) * rank / count


class History:
    def __init__(self, metrics: Metrics, *, interval: float = 5.0, keep: float = KEEP_S,
                 clock: Callable[[], float] = time.time):
        if not 1.0 <= interval <= keep:
            raise ValueError(f"the sample interval must be 1 s to {keep:g} s, not {interval:g}")
        self.metrics = metrics
        self.interval = interval
        self.keep = keep
        self.clock = clock
        self.started = clock()
        self.samples: deque[Sample] = deque(maxlen=math.ceil(keep / interval))
        self.marks: deque[Mark] = deque(maxlen=MAX_MARKS)
        # What happened before the history began is not charted: the first sample counts from here.
        self._last = self._read()
        self.bounds = self._last.bounds
        self._workers: tuple[tuple[str, str], ...] = ()

    # ---- recording -------------------------------------------------------------------------

    def worker_event(self, event: str, worker: Worker) -> None:
        """The pool's hook (Pool.watch): a membership change, marked when it happens."""
        kind = EVENTS.get(event)
        if kind is None:  # not a membership change ("others": a load report)
            return
        last = next((m for m in reversed(self.marks) if m.worker == worker.id), None)
        if last is None or last.event != kind:
            self.marks.append(Mark(self.clock(), worker.id, worker.role.label, kind))

    def sample(self) -> Sample:
        now = self._read()
        before, self._last = self._last, now
        figures = array("d", [a - b for a, b in zip(now.counts, before.counts)] + now.gauges)
        buckets = array("d")
        for key, _ in HISTOGRAMS:
            buckets.extend(a - b for a, b in zip(now.buckets[key], before.buckets[key]))
        ids = tuple(sorted(now.workers))[:MAX_WORKERS]
        if ids != self._workers:
            self._workers = ids
        loads = array("f", [x for w in self._workers for x in now.workers[w]])
        s = Sample(self.clock(), figures, buckets, self._workers, loads)
        self.samples.append(s)
        return s

    async def run(self) -> None:
        """Sample every `interval` seconds until cancelled."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due = max(due + self.interval, loop.time())  # after a stall: on, not catching up
            await asyncio.sleep(due - loop.time())
            try:
                self.sample()
            except Exception:  # one bad sample must not end the sampling
                logger.exception("dashboard sample failed")

    def _read(self) -> _Reading:
        by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in self.metrics.registry.collect():
            for s in family.samples:
                by_name.setdefault(s.name, []).append((s.labels, s.value))
        counts = [sum(v for labels, v in by_name.get(series, ()) if want.items() <= labels.items())
                  for _, series, want in COUNTS]
        gauges = [sum(v for _, v in by_name.get(series, ())) for _, series in GAUGES]
        buckets: dict[str, list[float]] = {}
        bounds: dict[str, list[float]] = {}
        for name, series in HISTOGRAMS:
            rows = sorted((float(labels["le"]), v)
                          for labels, v in by_name.get(series + "_bucket", ()))
            bounds[name] = [le for le, _ in rows]
            buckets[name] = [v for _, v in rows]
        workers: dict[tuple[str, str], list[float]] = {}
        for i, (_, series) in enumerate(WORKER_GAUGES):
            for labels, v in by_name.get(series, ()):
                workers.setdefault((labels["worker"], labels["role"]),
                                   [0.0] * len(WORKER_GAUGES))[i] = v
        return _Reading(counts, gauges, buckets, bounds, workers)

    # ---- the page's view -------------------------------------------------------------------

    def view(self, window: float) -> dict[str, Any]:
        """The last `window` seconds as points: JSON for the page."""
        now = self.clock()
        window = min(max(window, self.interval), self.keep)
        samples = [s for s in self.samples if s.t > now - window]
        per_step = max(1, math.ceil(window / self.interval / MAX_POINTS))
        # Steps end at the newest sample; the oldest step may hold fewer samples.
        groups = [samples[max(0, i - per_step):i]
                  for i in range(len(samples), 0, -per_step)][::-1]
        n_counts = len(COUNTS)
        counts: dict[str, list[float]] = {k: [] for k, _, _ in COUNTS}
        gauges: dict[str, list[float]] = {k: [] for k, _ in GAUGES}
        latency: dict[str, dict[str, list[float | None]]] = {
            k: {f"p{round(q * 100)}": [] for q in QUANTILES} for k, _ in HISTOGRAMS}
        window_buckets = {k: [0.0] * len(self.bounds[k]) for k, _ in HISTOGRAMS}
        for g in groups:
            for i, (k, _, _) in enumerate(COUNTS):
                counts[k].append(sum(s.figures[i] for s in g))
            for i, (k, _) in enumerate(GAUGES):
                gauges[k].append(g[-1].figures[n_counts + i])
            offset = 0
            for k, _ in HISTOGRAMS:
                n = len(self.bounds[k])
                summed = [sum(s.buckets[offset + j] for s in g) for j in range(n)]
                offset += n
                for q in QUANTILES:
                    latency[k][f"p{round(q * 100)}"].append(quantile(q, self.bounds[k], summed))
                window_buckets[k] = [a + b for a, b in zip(window_buckets[k], summed)]
        over_window = {k: {f"p{round(q * 100)}": quantile(q, self.bounds[k], window_buckets[k])
                           for q in QUANTILES} for k, _ in HISTOGRAMS}
        return {
            # The time axis: the window, or since the history began if that is later.
            "now": now, "since": max(now - window, self.started), "window_s": window,
            "interval_s": self.interval,
            "step_s": per_step * self.interval, "keep_s": self.keep,
            "t": [g[-1].t for g in groups],
            "counts": counts, "totals": {k: sum(v) for k, v in counts.items()},
            "gauges": gauges, "latency": latency, "latency_window": over_window,
            "workers": self._worker_series(groups),
            "marks": [m._asdict() for m in self.marks if m.t > now - window],
            "failures": [f._asdict() for f in reversed(self.metrics.recent_failures)
                         if f.t > now - window],
        }

    def _worker_series(self, groups: list[list[Sample]]) -> list[dict[str, Any]]:
        """Per worker, the gauges at the end of each step (None while it was not in the pool)."""
        seen = sorted({w for g in groups for w in g[-1].workers})[:MAX_WORKERS]
        series: dict[tuple[str, str], dict[str, list[float | None]]] = {
            w: {k: [] for k, _ in WORKER_GAUGES} for w in seen}
        positions: dict[tuple[tuple[str, str], ...], dict[tuple[str, str], int]] = {}
        width = len(WORKER_GAUGES)
        for g in groups:
            last = g[-1]
            if last.workers not in positions:
                positions[last.workers] = {w: i for i, w in enumerate(last.workers)}
            pos = positions[last.workers]
            for w in seen:
                i = pos.get(w)
                for j, (k, _) in enumerate(WORKER_GAUGES):
                    # float32 in the ring: 4 decimals are what it holds of a ratio
                    series[w][k].append(None if i is None else round(last.loads[i * width + j], 4))
        return [{"id": wid, "role": role, **series[(wid, role)]} for wid, role in seen]
