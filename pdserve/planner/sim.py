"""A discrete-event simulation of a pool (XpYd, colocated, or any mix) under a workload.

Each worker is an engine that steps: a step decodes one token for each of its R running
streams and may carry a chunk of prefill (at most `chunk_tokens`, from its FIFO queue, several
prompts batched). Times come from a Profile:
    decode only   step(R, kv)
    prefill only  a + sum(b*n + c*n*ctx/1000) over the chunk's pieces
    both          max(a, d0) + d1*R + d2*kv/1000 + sum(b*n + ...)  (one step, so a long chunk
                  stalls every stream on the worker: colocated serving's pauses)
A prompt prefilled on a prefill worker streams its first token there, is handed over after
`handoff_s` to the least-loaded decode worker, and decodes its other out-1 tokens there, one
per step. With first_token="decode" the first token waits for the decode worker's first step.
A prompt placed locally (colocated, under `local_threshold`, or by the SLO placement) is
prefilled by the worker that decodes it.

Why it is fast: a worker's steps are not events. Between two changes on a worker (a stream
joins or finishes, a chunk is scheduled) every step takes the same time, so the worker sleeps
until the next change and counts the steps it made. Events are O(requests), not O(tokens).
Routing samples 4 candidates (power of d choices) when a pool has more than 16 workers.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.workload import RequestClass, arrivals, class_counts
from pdserve.planner import placement
from pdserve.planner.capacity import Slo
from pdserve.planner.costmodel import Profile

WAKE, JOIN, ARRIVE = 0, 1, 2
SCAN_ALL = 16  # route by scanning every candidate up to this many workers, else sample
SAMPLE = 4


@dataclass(frozen=True)
class PoolSpec:
    prefill: int = 0
    decode: int = 0
    both: int = 0
    local_threshold: int | None = None  # prompts under it prefilled by their decode worker
    placement: str = "threshold"  # or "slo": placement.place() for every request
    first_token: str = "prefill"  # or "decode" (the controller's --first-token)

    def label(self) -> str:
        """As the bench names it: 1P1D@0 (every prompt handed over), 1P1D@128, colocated2;
        1P1D:slo for the adaptive placement."""
        parts = []
        if self.prefill or self.decode:
            how = ":slo" if self.placement == "slo" else f"@{self.local_threshold or 0}"
            parts.append(f"{self.prefill}P{self.decode}D{how}")
        if self.both:
            parts.append(f"colocated{self.both}")
        return "+".join(parts)


@dataclass
class SimResult:
    pool: str
    rate: float
    requests: int
    completed: int
    duration_s: float  # simulated time from the start to the last completion (as the bench)
    goodput: float  # requests/s meeting both SLO terms
    slo_attainment: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    by_class: dict[str, float] = field(default_factory=dict)  # SLO attainment per class
    local_share: float = 0.0  # requests prefilled by their decode worker
    events: int = 0
    wall_s: float = 0.0  # the simulation's own run time


class _Worker:
    __slots__ = ("i", "prefills", "decodes", "queue", "qtok", "pending", "heap", "r", "kv",
                 "steps", "t0", "dt", "wake", "version", "chunk", "busy", "load")

    def __init__(self, i: int, prefills: bool, decodes: bool):
        self.i, self.prefills, self.decodes = i, prefills, decodes
        self.queue: deque[int] = deque()  # requests waiting for (more) prefill
        self.qtok = 0  # their remaining prompt tokens
        self.pending: list[int] = []  # streams to join at the next step boundary
        self.heap: list[tuple[int, int]] = []  # (step count at which it finishes, request)
        self.r = self.kv = self.steps = 0
        self.t0 = self.dt = 0.0
        self.wake = -1  # step count of the scheduled wake (-1: idle)
        self.version = 0
        self.chunk: list[tuple[int, int]] = []  # (request, tokens) of the step in progress
        self.busy = False
        self.load = 0  # requests routed here and not finished (least-loaded routing)


def simulate(pool: PoolSpec, profile: Profile, classes: tuple[RequestClass, ...], rate: float,
             slo: Slo, *, duration: float = 60.0, num_requests: int | None = None,
             seed: int = 0, burstiness: float = 1.0, max_drain_s: float = 120.0) -> SimResult:
    """Simulate `pool` under `rate` requests/s of `classes` for `duration` seconds of arrivals
    (or `num_requests`), then let it drain for at most `max_drain_s`."""
    wall = time.perf_counter()
    n = num_requests if num_requests is not None else max(1, round(rate * duration))
    rng = random.Random(seed)
    labels = [k for k, c in enumerate(class_counts(classes, n)) for _ in range(c)]
    rng.shuffle(labels)
    arrive = arrivals(n, rate, burstiness, np.random.default_rng(seed))
    prompt = [rng.randint(classes[k].input_min, classes[k].input_max) for k in labels]
    out = [classes[k].output_len for k in labels]
    s = _Sim(pool, profile, slo, arrive, prompt, out, rng)
    events = s.run((arrive[-1] if arrive else 0.0) + max_drain_s)
    return s.result(labels, classes, rate, events, time.perf_counter() - wall)


class _Sim:
    def __init__(self, pool: PoolSpec, p: Profile, slo: Slo, arrive: list[float],
                 prompt: list[int], out: list[int], rng: random.Random):
        self.pool, self.p, self.slo, self.rng = pool, p, slo, rng
        self.arrive_t, self.prompt, self.out = arrive, prompt, out
        n = len(prompt)
        self.rem = list(prompt)  # prompt tokens still to prefill
        self.first = [math.nan] * n
        self.end = [math.nan] * n
        self.dest = [-1] * n  # decode worker, once known
        self.local = [False] * n
        self.workers = ([_Worker(i, True, False) for i in range(pool.prefill)]
                        + [_Worker(pool.prefill + i, False, True) for i in range(pool.decode)]
                        + [_Worker(pool.prefill + pool.decode + i, True, True)
                           for i in range(pool.both)])
        self.pre = [w for w in self.workers if w.prefills]
        self.dec = [w for w in self.workers if w.decodes]
        if not self.pre or not self.dec:
            raise ValueError(f"pool {pool.label()} cannot both prefill and decode")
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0

    def push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def pick(self, ws: list[_Worker], key: Callable[[_Worker], tuple[int, ...]]) -> _Worker:
        cands = ws if len(ws) <= SCAN_ALL else self.rng.sample(ws, SAMPLE)
        return min(cands, key=key)

    def run(self, horizon: float) -> int:
        for i, t in enumerate(self.arrive_t):
            self.push(t, ARRIVE, i)
        count = 0
        while self.events:
            t, _, kind, a, b = heapq.heappop(self.events)
            if t > horizon:
                break
            count += 1
            if kind == WAKE:
                w = self.workers[a]
                if b == w.version:
                    self.boundary(w, t)
            elif kind == JOIN:
                w = self.workers[a]
                w.pending.append(b)
                self.poke(w, t)
            else:
                self.arrive(a, t)
        return count

    def arrive(self, i: int, t: float) -> None:
        pool, n = self.pool, self.prompt[i]
        if pool.placement == "slo":
            w = self.place(i)
        else:
            w = self.pick(self.pre, lambda w: (w.qtok, w.load, w.i))
            if pool.local_threshold is not None and n < pool.local_threshold and not w.decodes:
                w = self.pick(self.dec, lambda w: (w.load, w.i))
        if w.decodes and self.dest[i] < 0:  # no handoff planned: it stays where it prefills
            self.local[i], self.dest[i] = True, w.i
        w.load += 1
        w.queue.append(i)
        w.qtok += n
        self.poke(w, t)

    def place(self, i: int) -> _Worker:
        """The adaptive placement (placement.place) over a sample of the workers."""
        ws = self.workers if len(self.workers) <= SCAN_ALL else self.rng.sample(
            self.workers, 2 * SAMPLE)
        role = {(True, False): "prefill", (False, True): "decode", (True, True): "both"}
        views = [placement.WorkerState(str(w.i), role[(w.prefills, w.decodes)], self.p,
                                       w.qtok, w.r + len(w.pending), w.kv) for w in ws]
        req = placement.Request(self.prompt[i], self.out[i])
        got = placement.place(req, views, self.slo, chunk_tokens=self.p.chunk_tokens,
                              handoff_in_ttft=self.pool.first_token == "decode")
        if got is None:  # the sample held no decode worker
            return self.pick(self.dec, lambda w: (w.load, w.i))
        if got.kind == placement.DISAGG:
            self.dest[i] = int(got.decode_worker)
            self.workers[self.dest[i]].load += 1
        return self.workers[int(got.prefill_worker)]

    def poke(self, w: _Worker, t: float) -> None:
        """Something arrived for `w` at `t`: start it if idle, else wake it at the next step
        boundary (a decode run sleeps until its next finish). An idle worker starts from an
        event at `t`, after everything else that arrives at `t`, so that it all starts together.
        """
        if not w.busy:
            w.busy, w.t0, w.dt = True, t, 0.0
            self.schedule(w, w.steps)
        elif not w.chunk:
            k = w.steps + max(1, math.ceil((t - w.t0) / w.dt - 1e-9)) if w.dt > 0 else w.steps
            if k < w.wake:
                self.schedule(w, k)

    def schedule(self, w: _Worker, k: int) -> None:
        w.wake = k
        w.version += 1
        self.push(w.t0 + (k - w.steps) * w.dt, WAKE, w.i, w.version)

    def boundary(self, w: _Worker, t: float) -> None:
        """`w` is at a step boundary at `t`: count the steps done, finish what finished, join
        what arrived, and start its next run of steps."""
        if w.busy:
            k = w.wake - w.steps
            w.kv += w.r * k
            w.steps = w.wake
        w.t0, w.busy = t, False
        end, prompt, out = self.end, self.prompt, self.out
        while w.heap and w.heap[0][0] <= w.steps:
            _, i = heapq.heappop(w.heap)
            end[i] = t
            w.r -= 1
            w.kv -= prompt[i] + out[i]
            w.load -= 1
        for i, tokens in w.chunk:
            self.rem[i] -= tokens
            if self.rem[i] == 0:
                self.prefilled(w, i, t)
        w.chunk = []
        fresh = []  # streams whose first token is the end of their first step here
        while w.pending and w.r < self.p.max_running:
            i = w.pending.pop(0)
            held = not self.local[i] and self.pool.first_token == "decode"
            left = out[i] if held else out[i] - 1
            if left <= 0:
                end[i] = t
                w.load -= 1
                continue
            w.r += 1
            w.kv += prompt[i] + 1
            heapq.heappush(w.heap, (w.steps + left, i))
            if held:
                fresh.append(i)
        p = self.p
        if w.queue:
            budget, chunk_s = p.chunk_tokens, 0.0
            for i in w.queue:
                take = min(self.rem[i], budget)
                done = prompt[i] - self.rem[i] + take
                chunk_s += take * (p.prefill_per_token_s + p.prefill_per_token_ctx_s * done / 1e3)
                w.chunk.append((i, take))
                budget -= take
                if budget <= 0:
                    break
            for i, take in w.chunk:
                w.qtok -= take
                if take == self.rem[i]:
                    w.queue.popleft()
            if w.r:
                w.dt = (max(p.prefill_base_s, p.step_base_s) + p.step_per_running_s * w.r
                        + p.step_per_kkv_s * w.kv / 1e3 + chunk_s)
            else:
                w.dt = p.prefill_base_s + chunk_s
            w.busy = True
            self.schedule(w, w.steps + 1)
        elif w.r:
            w.dt = p.step_seconds(w.r, w.kv)
            w.busy = True
            self.schedule(w, w.heap[0][0])
        else:
            w.wake = -1
        for i in fresh:
            self.first[i] = t + w.dt

    def prefilled(self, w: _Worker, i: int, t: float) -> None:
        if self.local[i] or self.pool.first_token == "prefill":
            self.first[i] = t
        if self.local[i]:
            w.pending.append(i)
            return
        w.load -= 1
        if self.dest[i] < 0:
            d = self.pick(self.dec, lambda d: (d.load, d.i))
            self.dest[i] = d.i
            d.load += 1
        self.push(t + self.p.handoff_s, JOIN, self.dest[i], i)

    def result(self, labels: list[int], classes: tuple[RequestClass, ...], rate: float,
               events: int, wall: float) -> SimResult:
        first, end = np.array(self.first), np.array(self.end)
        arrive = np.array(self.arrive_t)
        done = ~np.isnan(end)
        ttft = first - arrive
        out = np.array(self.out, dtype=float)
        tpot = np.where(out > 1, (end - first) / np.maximum(out - 1, 1), 0.0)
        good = done & (ttft * 1e3 <= self.slo.ttft_ms) & (tpot * 1e3 <= self.slo.tpot_ms)
        duration = float(np.nanmax(end)) if done.any() else 0.0
        lab = np.array(labels)
        return SimResult(
            self.pool.label(), rate, len(end), int(done.sum()), duration,
            float(good.sum() / duration) if duration > 0 else 0.0,
            float(good.mean()) if len(end) else 0.0,
            _percentiles(ttft[done]), _percentiles(tpot[done & (out > 1)]),
            {c.name: float(good[lab == k].mean()) for k, c in enumerate(classes)
             if (lab == k).any()},
            float(np.mean(self.local)), events, wall)


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    ms = values * 1e3
    out = {f"p{p}": float(np.percentile(ms, p)) for p in (50, 90, 99)}
    out["mean"] = float(ms.mean())
    return out
