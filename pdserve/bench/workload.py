"""What the benchmark sends: request classes, per-request lengths, arrival times (pure, seeded).

A workload is a list of `Item`s (prompt length, output length, arrival time). It is written as
a trace that vLLM's benchmark client replays (`--dataset-name timed_trace --self-timed`): the
client turns each item's `hash_ids` into random prompt token ids (16 per id) and sends them at the
item's timestamp. Hash ids are unique per item and per run, so no prompt hits a prefix cache,
except an item's shared prefix (`prefix`, `prefix_len`): every item with the same `prefix` starts
with the same hash ids, which vLLM's client turns into the same tokens (it seeds each 16-token
chunk from its hash id and length, and caches it for the run; PYTHONHASHSEED is fixed).

A run's arrivals follow one rate, or a `Schedule` (`--rates 1:60,6:60,2:60`): one run whose rate
changes at the segments' boundaries, each segment with its own count of arrivals.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeAlias

import numpy as np

CHUNK = 16  # vLLM's --timed-trace-chunk-hash-size default: prompt tokens per hash id


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float  # fraction of all requests
    input_min: int  # prompt tokens, uniform in [input_min, input_max]
    input_max: int
    output_len: int  # generated tokens (EOS is ignored)


@dataclass(frozen=True)
class Item:
    index: int
    cls: str
    input_len: int
    output_len: int
    arrival: float  # seconds after the first request may be sent
    prefix: int = -1  # items with the same prefix >= 0 share their first prefix_len tokens
    prefix_len: int = 0  # a multiple of CHUNK, shorter than input_len


# Issue 7's workload: long prompts with short answers interfering with short chat turns.
MIXED = (
    RequestClass("long", 0.3, 1500, 2000, 32),
    RequestClass("short", 0.7, 90, 110, 128),
)


def uniform(input_len: int, output_len: int, range_ratio: float = 0.0) -> tuple[RequestClass]:
    """One class, prompt lengths within +-range_ratio of input_len (vLLM's random dataset)."""
    lo = max(1, math.floor(input_len * (1 - range_ratio)))
    hi = max(lo, math.ceil(input_len * (1 + range_ratio)))
    return (RequestClass("random", 1.0, lo, hi, output_len),)


def parse_mix(spec: str) -> tuple[RequestClass, ...]:
    """`SHARE:IN_MIN-IN_MAX:OUT,...` e.g. `0.3:1500-2000:32,0.7:90-110:128`."""
    classes = []
    for i, part in enumerate(p for p in spec.split(",") if p.strip()):
        try:
            share, ins, out = part.strip().split(":")
            lo, _, hi = ins.partition("-")
            classes.append(RequestClass(f"c{i}", float(share), int(lo), int(hi or lo), int(out)))
        except ValueError:
            raise ValueError(f"bad mix part {part!r}: want SHARE:IN_MIN-IN_MAX:OUT") from None
    if not classes:
        raise ValueError("empty mix")
    for c in classes:
        if c.share <= 0 or c.input_min < 1 or c.input_max < c.input_min or c.output_len < 1:
            raise ValueError(f"bad mix class {c}")
    return tuple(classes)


def class_counts(classes: tuple[RequestClass, ...], n: int) -> list[int]:
    """Requests per class for n requests: shares rounded so that the counts sum to n."""
    total = sum(c.share for c in classes)
    exact = [n * c.share / total for c in classes]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(classes)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Arrival times as vLLM's client draws them: gamma gaps (shape=burstiness; 1 = Poisson),
    scaled so the last arrival is at n / rate. rate=inf sends everything at once."""
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    times *= (n / rate) / times[-1]
    return [float(t) for t in times]


@dataclass(frozen=True)
class Segment:
    rate: float  # req/s; 0 leaves the pool idle for `seconds`
    seconds: float

    @property
    def count(self) -> int:
        return round(self.rate * self.seconds)


@dataclass(frozen=True)
class Schedule:
    """One run whose arrival rate changes: its segments, back to back from t = 0."""

    segments: tuple[Segment, ...]

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.segments)

    @property
    def count(self) -> int:
        return sum(s.count for s in self.segments)

    @property
    def mean_rate(self) -> float:
        return self.count / self.seconds

    def starts(self) -> list[float]:
        """Each segment's start, in seconds after the run's t = 0."""
        return [sum(s.seconds for s in self.segments[:i]) for i in range(len(self.segments))]

    def label(self) -> str:
        return ",".join(f"{s.rate:g}:{s.seconds:g}" for s in self.segments)


Pace: TypeAlias = float | Schedule  # what one run's arrivals follow


def mean_rate(pace: Pace) -> float:
    """A run's rate: a schedule's requests over its seconds."""
    return pace.mean_rate if isinstance(pace, Schedule) else pace


def run_tag(pace: Pace) -> str:
    """A run's part of its files' names: `r4` for 4 req/s, `s1x60-6x60` for a schedule."""
    if isinstance(pace, Schedule):
        return "s" + "-".join(f"{s.rate:g}x{s.seconds:g}" for s in pace.segments)
    return f"r{pace:g}"


def parse_rates(spec: str) -> list[float] | Schedule:
    """`1,2,4`: separate runs at those rates; `1:60,6:60,2:60`: one run of RATE:SECONDS segments.
    ValueError naming the part that is wrong."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise ValueError("no rates given: want e.g. 1,2,4 or a schedule 1:60,6:60,2:60")
    timed = [":" in p for p in parts]
    if any(timed) and not all(timed):
        raise ValueError(f"{spec!r} mixes plain rates and RATE:SECONDS segments: give rates "
                         "(separate runs, e.g. 1,2,4) or a schedule (one run, e.g. 1:60,6:60)")
    if not any(timed):
        return [_plain_rate(p) for p in parts]
    schedule = Schedule(tuple(_segment(p) for p in parts))
    if schedule.count == 0:
        raise ValueError(f"schedule {spec!r} sends no request (rate x seconds rounds to 0)")
    return schedule


def _plain_rate(part: str) -> float:
    try:
        rate = float(part)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise ValueError(f"bad rate {part!r}: want a number of requests per second above 0")
    return rate


def _segment(part: str) -> Segment:
    rate_s, _, seconds_s = part.partition(":")
    try:
        rate, seconds = float(rate_s), float(seconds_s)
    except ValueError:
        rate = seconds = math.nan
    if not (0 <= rate < math.inf and 0 < seconds < math.inf):
        raise ValueError(f"bad schedule segment {part!r}: want RATE:SECONDS, e.g. 6:60 "
                         "(rate >= 0 req/s, seconds > 0)")
    return Segment(rate, seconds)


def piecewise_arrivals(schedule: Schedule, burstiness: float,
                       rng: np.random.Generator) -> list[float]:
    """Each segment's `count` arrivals, strictly inside it, with gamma gaps (shape=burstiness)
    as arrivals() draws them. One gap more than arrivals is drawn and the sum scaled to the
    segment's length: the last gap is the one crossing into the next segment, so every segment
    keeps its count and rate (for Poisson, its arrivals are uniform given the count)."""
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    out: list[float] = []
    for start, seg in zip(schedule.starts(), schedule.segments):
        if seg.count == 0:
            continue
        if math.isinf(burstiness):
            gaps = np.ones(seg.count + 1)
        else:
            gaps = rng.gamma(shape=burstiness, scale=1.0, size=seg.count + 1)
        times = np.cumsum(gaps) * (seg.seconds / gaps.sum())
        out += [start + float(t) for t in times[:-1]]
    return out


def retime(items: list[Item], times: list[float]) -> list[Item]:
    """The same requests at other arrival times (what they send does not depend on when)."""
    assert len(items) == len(times), "one arrival per item"
    return [replace(it, arrival=t) for it, t in zip(items, times)]


def make_workload(classes: tuple[RequestClass, ...], n: int, rate: float, burstiness: float,
                  seed: int) -> list[Item]:
    """n requests with exactly the classes' shares (rounded), in a seeded random order."""
    rng = random.Random(seed)
    labels = [c for c, k in zip(classes, class_counts(classes, n)) for _ in range(k)]
    rng.shuffle(labels)
    times = arrivals(n, rate, burstiness, np.random.default_rng(seed))
    return [Item(i, c.name, rng.randint(c.input_min, c.input_max), c.output_len, t)
            for i, (c, t) in enumerate(zip(labels, times))]


def write_trace(items: list[Item], path: Path, run: int = 0) -> Path:
    """A JSONL trace for vLLM's `timed_trace` dataset; `run` keeps prompts of runs distinct."""
    base = (run + 1) * 10_000_000
    with open(path, "w") as f:
        for it in items:
            first = base + it.index * 1_000
            chunks = math.ceil(it.input_len / CHUNK)
            assert chunks < 1_000, "prompt too long for the hash-id layout"
            shared: list[int] = []
            if it.prefix >= 0:
                assert it.prefix_len % CHUNK == 0 and it.prefix_len < it.input_len
                # Negative, so that no item's own ids can collide with a shared prefix's.
                start = -(base + it.prefix * 1_000)
                shared = list(range(start, start - it.prefix_len // CHUNK, -1))
            own = list(range(first + len(shared), first + chunks))
            f.write(json.dumps({"timestamp": round(it.arrival, 6), "input_length": it.input_len,
                                "output_length": it.output_len,
                                "hash_ids": shared + own}) + "\n")
    return path


def describe(classes: tuple[RequestClass, ...]) -> str:
    return ", ".join(f"{c.share:.0%} {c.name}: prompts {c.input_min}-{c.input_max} tokens, "
                     f"{c.output_len} out" for c in classes)
