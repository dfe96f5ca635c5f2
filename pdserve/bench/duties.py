"""What auto workers were asked to do during a run: their duties over time, and how fast they adapt.

An auto worker (`pdserve worker --role auto`) is given a duty by the controller's planner
(prefill, decode or both) and may be given another at any time. During each run of an auto
configuration, DutyPoller reads `GET /pd/workers` about once a second in a thread and keeps each
change; the pure functions below turn those samples into the run's timeline (seconds since the
run's t = 0), its changes and, for a schedule run, each segment's time to adapt: from the
segment's start to the last change within it; markdown() describes them in report.md.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Self

Duties = dict[str, str]  # worker -> duty
Fetch = Callable[[], list[dict[str, Any]]]  # one read of /pd/workers


@dataclass(frozen=True)
class Sample:
    t: float  # seconds (time.monotonic() while polling; since the run's t = 0 once aligned)
    duties: Duties


@dataclass(frozen=True)
class Change:
    t: float  # seconds since the run's t = 0 (negative: before its first request was due)
    worker: str
    old: str
    new: str


def duties_of(workers: Sequence[Mapping[str, Any]], names: Mapping[int, str]) -> Duties:
    """Each worker's duty (a fixed-role worker's is its role), by the bench's name for its
    process when its pid is known, else by its id."""
    return {names.get(int(w.get("pid") or 0), str(w["id"])): str(w.get("duty") or w["role"])
            for w in workers}


def timeline(samples: Sequence[Sample], zero: float) -> list[Sample]:
    """The samples with their times counted from `zero` (the run's t = 0, same clock)."""
    return [Sample(round(s.t - zero, 3), dict(s.duties)) for s in samples]


def changes(samples: Sequence[Sample]) -> list[Change]:
    """Every duty that differs from the worker's last known one. A worker's first sighting is its
    starting duty, not a change; a worker missing from a sample keeps its last known duty."""
    known: Duties = {}
    out: list[Change] = []
    for s in samples:
        for worker, duty in s.duties.items():
            old = known.get(worker)
            if old is not None and old != duty:
                out.append(Change(s.t, worker, old, duty))
            known[worker] = duty
    return out


def time_to_adapt(found: Sequence[Change], starts: Sequence[float]) -> list[float | None]:
    """For each segment (starts[i] to starts[i + 1]; the last one until the run ends), the
    seconds from its start to the last change within it; None when nothing changed in it."""
    out: list[float | None] = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else float("inf")
        inside = [c.t for c in found if start <= c.t < end]
        out.append(round(max(inside) - start, 3) if inside else None)
    return out


def summary(samples: Sequence[Sample], zero: float,
            starts: Sequence[float] | None = None) -> dict[str, Any]:
    """A run's duties as results.json keeps them: the timeline, its changes and (for a schedule
    run, given its segments' starts) the time to adapt of each segment."""
    line = timeline(samples, zero)
    found = changes(line)
    out: dict[str, Any] = {"timeline": [asdict(s) for s in line],
                           "changes": [asdict(c) for c in found]}
    if starts is not None:
        out["time_to_adapt_s"] = time_to_adapt(found, starts)
    return out


def fetch_workers(base_url: str, timeout: float = 2.0) -> list[dict[str, Any]]:
    with urllib.request.urlopen(base_url + "/pd/workers", timeout=timeout) as r:
        workers: list[dict[str, Any]] = json.loads(r.read())
    return workers


class DutyPoller:
    """Reads the pool every `interval` seconds in a daemon thread and keeps a Sample each time
    the duties differ from the last kept ones. A failed read is skipped: the controller is busy
    serving the load, and the next read will do."""

    def __init__(self, fetch: Fetch, names: Mapping[int, str] | None = None,
                 interval: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.fetch, self.names = fetch, dict(names or {})
        self.interval, self.clock = interval, clock
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duty-poller", daemon=True)

    def poll(self) -> None:
        try:
            duties = duties_of(self.fetch(), self.names)
        except (OSError, ValueError, KeyError, TypeError):
            return
        if not self.samples or duties != self.samples[-1].duties:
            self.samples.append(Sample(self.clock(), duties))

    def _run(self) -> None:
        while True:
            began = self.clock()
            self.poll()
            # A slow read (up to its timeout) does not stretch the period.
            if self._stop.wait(max(0.0, self.interval - (self.clock() - began))):
                return

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        return list(self.samples)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def watch(auto: bool, url: str, groups: Mapping[str, int]) -> Iterator[DutyPoller | None]:
    """A DutyPoller for the duration of the block, for auto configurations (else None); workers
    named as the bench started them (by pid)."""
    if not auto:
        yield None
        return
    names = {pid: name for name, pid in groups.items()}
    with DutyPoller(lambda: fetch_workers(url, timeout=2.0), names) as poller:
        yield poller


def run_zero(client_zero: float | None, launched: float) -> tuple[float, str]:
    """The run's t = 0 on this process's monotonic clock, and what it is: the trace's t = 0 as
    the client's clock says (vLLM's client records perf_counter(), CLOCK_MONOTONIC on Linux as
    time.monotonic() is here); when the client gives no such time, when it was launched."""
    same = time.get_clock_info("perf_counter").implementation == \
        time.get_clock_info("monotonic").implementation
    if client_zero is not None and same and launched - 1.0 <= client_zero <= time.monotonic():
        return client_zero, "trace start"
    return launched, "client launch"


def markdown(title: str, run: Mapping[str, Any]) -> list[str]:
    """report.md's lines for one run of an auto configuration: the duties at its start, a line
    per change (seconds since its t = 0, negative before it) and, for a schedule, each
    segment's time to adapt."""
    d = run["duties"]
    out = ["", f"### {title} (seconds since the {d.get('since', 'trace start')})", ""]
    line = d.get("timeline") or []
    if not line:
        return [*out, "- no reading of /pd/workers succeeded during the run"]
    first = ", ".join(f"{w} {duty}" for w, duty in sorted(line[0]["duties"].items()))
    out.append(f"- at {line[0]['t']:.1f} s: {first}")
    out += [f"- {c['t']:.1f} s: {c['worker']} {c['old']} -> {c['new']}"
            for c in d.get("changes", [])] or ["- no duty changed"]
    if counted := _role_changes(run):
        out.append(f"- the controller counted (pdserve_role_changes_total): {counted}")
    return out + _adapt_lines(run)


def _adapt_lines(run: Mapping[str, Any]) -> list[str]:
    adapt = run.get("duties", {}).get("time_to_adapt_s")
    segments = run.get("segments") or []
    if adapt is None or len(adapt) != len(segments):
        return []
    cells = [f"{seg['rate']:g} req/s from {seg['start_s']:g} s: "
             + ("no change" if t is None else f"{t:.1f} s") for seg, t in zip(segments, adapt)]
    return ["- time to adapt (segment start -> its last duty change): " + "; ".join(cells)]


def _role_changes(run: Mapping[str, Any]) -> str:
    found = {k: v for k, v in (run.get("controller") or {}).items()
             if k.startswith("pdserve_role_changes_total")}
    return ", ".join(f"{k.removeprefix('pdserve_role_changes_total') or 'all'} +{v:g}"
                     for k, v in sorted(found.items()))
