"""Closed-form predictions for a pool split into prefill, decode and both workers.

The role planner asks this every few seconds about every split it could move to, at any pool
size, so each prediction is O(1); `pdserve plan` uses it to shortlist the splits it simulates
(sim.py, which sees the tails these means do not).

The model, per worker:
- Prefill: spread evenly over the workers that prefill; each an M/G/1 queue
  (Pollaczek-Khinchine): wait = lam*E[S^2] / (2(1-rho)), TTFT = wait + E[S]. Separate queues
  per worker, so it is pessimistic against least-loaded routing. On a `both` worker each
  prefill chunk also waits for the decode step it shares.
- Decode: streams spread by free capacity (a `both` worker counts for the share its prefills
  leave, as a load-aware router ends up doing). A worker steps all its streams at once; a step
  takes step(R) for R streams, each getting a token. Little's law (R = tokens/s x TPOT) with
  TPOT = step(R) solves for R in closed form; no solution is a saturated worker (TPOT
  infinite). On a `both` worker decoding only gets the time prefill leaves: TPOT = step(R) /
  (1 - rho_prefill).
- A handoff adds `handoff_s` to TTFT (`--first-token decode`) or, with the first token streamed
  from the prefill (the default), to the stream's first gap: handoff_s / (out-1) of its TPOT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.planner.costmodel import Costs

INF = math.inf


@dataclass(frozen=True)
class Slo:
    """Goodput's SLO: a request is good when both its TTFT and its TPOT are within these."""

    ttft_ms: float
    tpot_ms: float

    @classmethod
    def parse(cls, pairs: list[str]) -> Slo:
        """`ttft:MS tpot:MS` (vLLM's --goodput syntax); a term not given is not limited."""
        values = {"ttft": math.inf, "tpot": math.inf}
        for item in " ".join(pairs).split():
            name, sep, ms = item.partition(":")
            if not sep or name not in values:
                raise ValueError(f"bad SLO {item!r}: want ttft:MS and/or tpot:MS")
            values[name] = float(ms)
        return cls(values["ttft"], values["tpot"])

    def slack(self, ttft_s: float, tpot_s: float) -> float:
        """The smaller relative headroom of the two terms (negative: violated)."""
        return min(1.0 - ttft_s * 1e3 / self.ttft_ms, 1.0 - tpot_s * 1e3 / self.tpot_ms)

    def slacks(self, ttft_s: float, tpot_s: float) -> tuple[float, float]:
        """Both terms' relative headroom, the smaller first: comparing these tuples prefers the
        most slack on the binding term, then on the other (a tie on TPOT goes to the lower
        TTFT)."""
        a, b = 1.0 - ttft_s * 1e3 / self.ttft_ms, 1.0 - tpot_s * 1e3 / self.tpot_ms
        return (a, b) if a <= b else (b, a)

    def violation(self, ttft_s: float, tpot_s: float) -> float:
        """How far over the SLO, relative, summed over the two terms (0: met)."""
        return (max(0.0, ttft_s * 1e3 / self.ttft_ms - 1.0)
                + max(0.0, tpot_s * 1e3 / self.tpot_ms - 1.0))

    def meets(self, ttft_s: float, tpot_s: float, headroom: float = 0.0) -> bool:
        return self.slack(ttft_s, tpot_s) >= headroom


@dataclass(frozen=True)
class Demand:
    """Smoothed load: request rate and the mean shape of a request."""

    rate: float  # requests/s
    prompt_tokens: float  # mean prompt tokens each request must compute (uncached)
    output_tokens: float  # mean output tokens
    prompt_sq: float | None = None  # mean of prompt_tokens**2 (None: every prompt alike)


@dataclass(frozen=True)
class Split:
    """How many workers take each role (auto and fixed together)."""

    prefill: int = 0
    decode: int = 0
    both: int = 0

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.both

    def label(self) -> str:
        parts = []
        if self.prefill or self.decode:
            parts.append(f"{self.prefill}P{self.decode}D")
        if self.both:
            parts.append(f"{self.both}B")
        return "+".join(parts) or "empty"

    def count(self, role: str) -> int:
        return {"prefill": self.prefill, "decode": self.decode, "both": self.both}[role]

    def moved(self, old: str, new: str) -> Split:
        """This split with one worker moved from role `old` to role `new`."""
        counts = {"prefill": self.prefill, "decode": self.decode, "both": self.both}
        counts[old] -= 1
        counts[new] += 1
        return Split(**counts)


@dataclass(frozen=True)
class Prediction:
    split: Split
    ttft_s: float  # mean TTFT over requests (the slower path where there are two)
    tpot_s: float  # mean TPOT (likewise)
    prefill_util: float  # busy share of a prefill-capable worker
    streams_per_worker: float  # running requests on a decode-capable worker

    def slack(self, slo: Slo) -> float:
        return slo.slack(self.ttft_s, self.tpot_s)

    def violation(self, slo: Slo) -> float:
        return slo.violation(self.ttft_s, self.tpot_s)


def prefill_moments(demand: Demand, costs: Costs) -> tuple[float, float]:
    """E[S] and E[S^2] of one request's prefill time."""
    m = demand.prompt_tokens
    m2 = demand.prompt_sq if demand.prompt_sq is not None else m * m
    sd = math.sqrt(max(0.0, m2 - m * m))
    # The mean of a convex-ish cost over the spread, by two points at mean +- sd (exact for
    # linear and quadratic costs).
    lo, hi = costs.prefill_seconds(max(0.0, m - sd)), costs.prefill_seconds(m + sd)
    return 0.5 * (lo + hi), 0.5 * (lo * lo + hi * hi)


def queue_wait(lam: float, s1: float, s2: float) -> float:
    """Mean wait in an M/G/1 queue (infinite when saturated)."""
    rho = lam * s1
    if rho >= 1.0:
        return INF
    return lam * s2 / (2.0 * (1.0 - rho))


def decode_streams(tokens_per_s: float, kv_per_stream: float, costs: Costs,
                   busy_share: float = 0.0) -> float:
    """Running streams R on a worker decoding `tokens_per_s` (INF when it cannot keep up),
    from R = tokens_per_s * step(R) / (1 - busy_share) with step linear in R."""
    avail = 1.0 - busy_share
    if avail <= 0.0:
        return INF
    base = costs.step_seconds(0, 0)
    per = costs.step_seconds(1, kv_per_stream) - base  # d1 + d2*kv/1000
    k = tokens_per_s / avail
    denom = 1.0 - k * per
    if denom <= 0.0:
        return INF
    return k * base / denom


def predict(split: Split, demand: Demand, costs: Costs, *, handoff_in_ttft: bool = False,
            chunk_tokens: int = 2048) -> Prediction:
    pc = split.prefill + split.both
    dc = split.decode + split.both
    if pc == 0 or dc == 0:
        return Prediction(split, INF, INF, INF, INF)
    if demand.rate <= 0:
        return Prediction(split, costs.prefill_seconds(demand.prompt_tokens),
                          costs.step_seconds(1, 0), 0.0, 0.0)
    out = max(demand.output_tokens - 1.0, 1.0)  # tokens after the first
    kv = demand.prompt_tokens + demand.output_tokens / 2
    s1, s2 = prefill_moments(demand, costs)
    lam_p = demand.rate / pc
    util = lam_p * s1
    # Decode goes by free capacity (what a load-aware router converges to): a decode worker
    # weighs 1, a `both` worker what its prefills leave of it.
    free = max(0.0, 1.0 - util)
    weights = split.decode + split.both * free
    lam_d = demand.rate / weights if weights > 0 else INF
    lam_db = lam_d * free
    ttfts, tpots = [], []
    streams = 0.0
    if split.prefill:
        ttft = queue_wait(lam_p, s1, s2) + s1
        ttfts.append(ttft + (costs.handoff_s if handoff_in_ttft else 0.0))
    if split.decode:
        r = decode_streams(lam_d * out, kv, costs)
        streams = r
        tpot = costs.step_seconds(max(1.0, r), max(r, 1.0) * kv) if r < INF else INF
        handed = split.prefill / pc  # requests prefilled elsewhere come with a handoff gap
        tpots.append(tpot + (0.0 if handoff_in_ttft else handed * costs.handoff_s / out))
    if split.both:
        # Prefill and decode share the worker: each prefill chunk rides with a decode step, and
        # decoding runs only in the time prefill leaves. Fixed point over (R, rho).
        chunks = max(1.0, math.ceil(demand.prompt_tokens / chunk_tokens))
        r, rho = 0.0, util
        for _ in range(8):
            step = costs.step_seconds(max(1.0, r), max(r, 1.0) * kv) if r else 0.0
            rho = lam_p * (s1 + chunks * step)
            r_new = decode_streams(lam_db * out, kv, costs, busy_share=rho)
            if r_new == INF or rho >= 1.0:
                r = INF
                break
            r = r_new
        if r == INF:
            ttfts.append(INF)
            tpots.append(INF)
        else:
            step = costs.step_seconds(max(1.0, r), max(r, 1.0) * kv)
            s1b = s1 + chunks * step
            ttfts.append(queue_wait(lam_p, s1b, s2 * (s1b / s1) ** 2) + s1b)
            tpots.append(step / (1.0 - rho))
            util, streams = rho, max(streams, r)
    return Prediction(split, max(ttfts), max(tpots), util, streams)


def desired_workers(role: str, demand: Demand, costs: Costs, slo: Slo, *,
                    headroom: float = 0.1, handoff_in_ttft: bool = False,
                    limit: int = 1 << 20) -> int:
    """Fewest workers of `role` ("prefill", "decode" or "both") that meet the SLO with
    `headroom` for this demand: prefill counting TTFT only, decode TPOT only (each with the other
    side plentiful), both the two together. For an autoscaler's metric; `limit` if unreachable.
    """
    if demand.rate <= 0:
        return 1

    def ok(n: int) -> bool:
        if role == "prefill":
            p = predict(Split(n, limit, 0), demand, costs, handoff_in_ttft=handoff_in_ttft)
            return slo.meets(p.ttft_s, 0.0, headroom)
        if role == "decode":
            p = predict(Split(limit, n, 0), demand, costs, handoff_in_ttft=handoff_in_ttft)
            return slo.meets(0.0, p.tpot_s, headroom)
        if role == "both":
            p = predict(Split(0, 0, n), demand, costs)
            return slo.meets(p.ttft_s, p.tpot_s, headroom)
        raise ValueError(f"unknown role {role!r}")

    if not ok(limit):
        return limit
    lo, hi = 1, 1
    while not ok(hi):
        lo, hi = hi + 1, hi * 2
    while lo < hi:  # the smallest n in [lo, hi] with ok(n)
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
