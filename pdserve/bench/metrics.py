"""Per-request records and the figures computed from them, as vLLM's benchmark client defines them.

- TTFT: request sent -> first streamed chunk with a token.
- ITL: each gap between streamed chunks after the first (all gaps of all requests pooled).
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests with one token have none.
- E2E: request sent -> last chunk.
- Goodput (DistServe): completed requests per second of benchmark time whose TTFT and TPOT both
  meet the SLO (a one-token request counts TPOT 0, as vLLM does).
- Prefix cache (when the client records usage.prompt_tokens_details.cached_tokens, as
  conversations.py does): prompt tokens computed = prompt tokens - cached tokens, summed over
  the completed requests; hit rate = cached / prompt tokens.
- Segments of a schedule run (workload.Schedule): its requests split by when they were sent,
  counted from the run's t = 0 (clock_zero); each segment's goodput is over its own seconds.
Percentiles are numpy's linear interpolation, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.bench.workload import Schedule

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class Record:
    input_len: int
    output_len: int
    ttft: float  # seconds
    e2e: float
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    cls: str = ""
    error: str = ""
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache

    @property
    def ok(self) -> bool:
        return not self.error and self.output_len > 0

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = 2000.0
    tpot_ms: float | None = 18.0
    e2e_ms: float | None = None

    def met(self, r: Record) -> bool:
        tpot = r.tpot or 0.0
        return (r.ok and (self.ttft_ms is None or r.ttft * 1e3 <= self.ttft_ms)
                and (self.tpot_ms is None or tpot * 1e3 <= self.tpot_ms)
                and (self.e2e_ms is None or r.e2e * 1e3 <= self.e2e_ms))

    def label(self) -> str:
        parts = [f"{k}:{v:g}" for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms),
                                              ("e2el", self.e2e_ms)) if v is not None]
        return " ".join(parts)


def parse_slo(pairs: Iterable[str]) -> Slo:
    """`ttft:2000 tpot:18` (milliseconds; vLLM's --goodput syntax, `e2el` also accepted)."""
    values: dict[str, float] = {}
    for pair in pairs:
        for item in pair.split():
            name, sep, ms = item.partition(":")
            name = {"e2el": "e2e"}.get(name, name)
            if not sep or name not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"bad SLO {item!r}: want ttft:MS, tpot:MS or e2el:MS")
            values[name] = float(ms)
    if not values:
        return Slo()
    return Slo(values.get("ttft"), values.get("tpot"), values.get("e2e"))


def records_from_vllm(result: dict[str, Any], classes: Sequence[str] = ()) -> list[Record]:
    """Records from a result file of vLLM's client saved with --save-detailed (or of
    conversations.py, which adds `cached_tokens`)."""
    n = len(result["ttfts"])
    latencies = result.get("latencies") or [
        t + sum(g) for t, g in zip(result["ttfts"], result["itls"])]
    cached = result.get("cached_tokens") or [None] * n
    return [Record(input_len=result["input_lens"][i], output_len=result["output_lens"][i],
                   ttft=result["ttfts"][i], e2e=latencies[i], itl=list(result["itls"][i]),
                   start=result["start_times"][i], cls=classes[i] if i < len(classes) else "",
                   error=result["errors"][i] or "", cached_tokens=cached[i])
            for i in range(n)]


def percentiles(values: Sequence[float], ps: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """`{"p50": ms, ...}` from values in seconds; NaN when there are none."""
    if not values:
        return {f"p{p:g}": float("nan") for p in ps} | {"mean": float("nan")}
    arr = np.asarray(values, dtype=float) * 1e3
    out = {f"p{p:g}": float(np.percentile(arr, p)) for p in ps}
    out["mean"] = float(arr.mean())
    return out


def samples(records: Sequence[Record], metric: str) -> list[float]:
    ok = [r for r in records if r.ok]
    if metric == "ttft":
        return [r.ttft for r in ok]
    if metric == "e2e":
        return [r.e2e for r in ok]
    if metric == "tpot":
        return [t for r in ok if (t := r.tpot) is not None]
    if metric == "itl":
        return [g for r in ok for g in r.itl]
    raise ValueError(metric)


PAUSE_S = 0.1  # a gap between two tokens this long is a visible pause in the stream


def pauses(records: Sequence[Record]) -> dict[str, float]:
    """The stream's worst gaps, which ITL p99 hides when they are under 1% of all gaps (a
    colocated engine's prefill pauses only the few streams on that engine): ITL p99.9, the
    longest gap, the share of gaps and of requests with a pause >= PAUSE_S, and the p90 over
    requests of each one's worst gap; also the same without each stream's first gap (the KV
    handoff's, in P/D), and that first gap's p50 and p99 in the later gaps' p50 (the decode
    step as clients saw it under the same load)."""
    ok = [r for r in records if r.ok and r.itl]
    gaps = [g for r in ok for g in r.itl]
    later = [g for r in ok for g in r.itl[1:]]
    if not gaps:
        return {}
    worst = [max(r.itl) for r in ok]
    first = percentiles([r.itl[0] for r in ok], (50, 99))
    step = percentiles(later, (50,))["p50"] if later else float("nan")
    return {
        "itl_p99.9_ms": percentiles(gaps, (99.9,))["p99.9"],
        "itl_max_ms": 1e3 * max(gaps),
        "gaps_paused": sum(g >= PAUSE_S for g in gaps) / len(gaps),
        "requests_paused": sum(w >= PAUSE_S for w in worst) / len(worst),
        "worst_gap_p90_ms": percentiles(worst, (90,))["p90"],
        "later_itl_p99.9_ms": percentiles(later, (99.9,))["p99.9"] if later else float("nan"),
        "later_itl_max_ms": 1e3 * max(later) if later else float("nan"),
        "first_gap_p50_ms": first["p50"],
        "first_gap_p99_ms": first["p99"],
        "first_gap_p50_steps": first["p50"] / step if step else float("nan"),
        "first_gap_p99_steps": first["p99"] / step if step else float("nan"),
    }


def summarize(records: Sequence[Record], duration: float, slo: Slo) -> dict[str, Any]:
    """Latency percentiles (ms), throughput and goodput for one run of `duration` seconds."""
    ok = [r for r in records if r.ok]
    good = sum(slo.met(r) for r in records)
    out: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": sum(r.output_len for r in ok) / duration if duration > 0 else 0.0,
        "goodput": good / duration if duration > 0 else 0.0,
        "slo_attainment": good / len(records) if records else 0.0,
    }
    for m in METRICS:
        out[m] = percentiles(samples(records, m))
    out["pauses"] = pauses(records)
    if cache := cache_summary(records):
        out["cache"] = cache
    return out


def cache_summary(records: Sequence[Record]) -> dict[str, Any]:
    """Prompt tokens, the part served from the prefix cache and the part computed, over the
    completed requests whose cached tokens are known; {} when none are."""
    known = [r for r in records if r.ok and r.cached_tokens is not None]
    if not known:
        return {}
    prompt = sum(r.input_len for r in known)
    cached = sum(r.cached_tokens or 0 for r in known)
    return {"requests": len(known), "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": prompt - cached, "hit_rate": cached / prompt if prompt else 0.0}


def summarize_by_class(records: Sequence[Record], duration: float,
                       slo: Slo) -> dict[str, dict[str, Any]]:
    names = sorted({r.cls for r in records if r.cls})
    return {c: summarize([r for r in records if r.cls == c], duration, slo) for c in names}


def clock_zero(starts: Sequence[float], arrivals: Sequence[float]) -> float | None:
    """The run's t = 0 on the client's clock: no request is sent before its arrival time, so it
    is the least of (sent - arrival); None when the arrival times are not known."""
    if not starts or len(starts) != len(arrivals):
        return None
    return min(s - a for s, a in zip(starts, arrivals))


def split_by_start(records: Sequence[Record], zero: float,
                   starts: Sequence[float]) -> list[list[Record]]:
    """Records by the segment they were sent in: segment i from starts[i] to starts[i + 1]
    (seconds after `zero`); the last one takes every later request."""
    out: list[list[Record]] = [[] for _ in starts]
    for r in records:
        t = r.start - zero
        i = max((k for k, s in enumerate(starts) if t >= s), default=0)
        out[i].append(r)
    return out


def summarize_segments(records: Sequence[Record], zero: float, schedule: Schedule,
                       slo: Slo) -> list[dict[str, Any]]:
    """summarize() for each segment of a schedule run, goodput over the segment's seconds."""
    starts = schedule.starts()
    parts = split_by_start(records, zero, starts)
    return [{"rate": seg.rate, "start_s": start, "seconds": seg.seconds,
             "summary": summarize(recs, seg.seconds, slo)}
            for recs, start, seg in zip(parts, starts, schedule.segments)]
