"""The pool page (GET /pd/dashboard) in a real headless browser, Debian's chromium.

A real controller (`pdserve controller`, vLLM's OpenAI server) runs with five fake workers in
their own processes (`python -m pdserve.fake worker`): two prefill, three decode, driven through
a scripted timeline: the five join, a burst of requests, one decode worker drained while a long
request still streams through it (it stays "draining"), another decode worker killed with
SIGKILL while a request streams through it (it turns suspect, then "dead", and the request
migrates), then a few completions for the latency table. Chromium loads the page for each
window (5 min, 1 h), runs its script and dumps the DOM it rendered; the tests check the worker
table, the summary counts and the latency table; that every chart is drawn, each point where
its axes put its value; that the points add up to what /metrics says; that the membership
marks sit at the times the events happened; and the failures list. A screenshot is taken
(PDSERVE_DASHBOARD_SCREENSHOT=file.png keeps a copy).
Without chromium the tests fail (scripts/test.sh installs it when run as root).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
from procs import Proc, free_port, get_json, pdserve, wait_for

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WORKERS = {"prefill-a": "prefill", "prefill-b": "prefill",
           "decode-a": "decode", "decode-b": "decode", "decode-c": "decode"}
DECODE_DELAY = 0.05  # s per token on the fake workers: the long request takes ~200 s
LONG_TOKENS = 4000
MIGRATED_TOKENS = 300  # the request on the killed worker: ~15 s, the kill is seen in ~10
BURST = 12
SAMPLE_S = 1  # --dashboard-interval
WINDOWS = (300, 3600)


def chromium() -> str:
    path = shutil.which("chromium") or next(
        (p for p in ("/usr/bin/chromium", "/usr/lib/chromium/chromium") if os.path.exists(p)),
        None)
    if path is None:
        pytest.fail("Debian's chromium is not installed, and the dashboard test needs a real "
                    "browser: `apt-get install -y chromium` (scripts/test.sh installs it when run "
                    "as root)", pytrace=False)
    return path


def run_chromium(args: list[str], profile: Path, timeout: float = 90.0) -> str:
    """Run headless chromium once (in its own process group) and return its stdout."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--disable-extensions",
           "--disable-dev-shm-usage", "--mute-audio", f"--user-data-dir={profile}",
           "--virtual-time-budget=5000", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"chromium did not finish within {timeout:.0f} s: {' '.join(cmd)}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # helpers (zygote, GPU/network services) left over
        except ProcessLookupError:
            pass
    if p.returncode != 0:
        pytest.fail(f"chromium exited with {p.returncode}:\n{err.decode(errors='replace')[-3000:]}")
    return out.decode(errors="replace")


@dataclass
class Chart:
    """One chart as the browser drew it."""

    svg: dict[str, str]  # the svg element's data-* attributes (its time and value axes)
    lines: dict[str, dict[str, str]] = field(default_factory=dict)  # data-series -> attributes
    marks: list[dict[str, str]] = field(default_factory=list)  # membership marks' attributes
    legend: dict[str, str] = field(default_factory=dict)  # data-series -> text


@dataclass
class Page:
    """What the browser rendered, read from the dumped DOM."""

    worker_rows: list[dict] = field(default_factory=list)  # data-* attributes + cell texts
    summary: dict[str, str] = field(default_factory=dict)  # data-key -> text
    latency: dict[str, list[str]] = field(default_factory=dict)  # metric label -> p50/p90/p99
    text: dict[str, str] = field(default_factory=dict)  # id -> text of a few elements
    charts: dict[str, Chart] = field(default_factory=dict)  # data-chart -> chart
    failures: list[dict] = field(default_factory=list)  # rows of #failures
    events: list[dict] = field(default_factory=list)  # rows of #events
    routes: dict[str, str] = field(default_factory=dict)  # data-key -> text of the route cards


class _DomReader(HTMLParser):
    IDS = ("err", "rate", "updated", "window", "step")
    ROWS = {"workers": "worker_rows", "failures": "failures", "events": "events"}

    def __init__(self):
        super().__init__()
        self.page = Page()
        self.table: str | None = None  # id of the table we are in
        self.in_body = False
        self.row: dict | None = None
        self.cell: list[str] | None = None
        self.span_key: tuple[dict[str, str], str] | None = None  # (where, key) of a card
        self.cards: dict[str, str] | None = None  # summary or routes, while inside it
        self.id_stack: list[str | None] = []  # text collectors for IDS
        self.chart: Chart | None = None
        self.legend_key: str | None = None

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        data = {k: v for k, v in a.items() if k.startswith("data-")}
        if tag == "table":
            self.table = a.get("id")
        elif tag == "tbody":
            self.in_body = True
        elif tag == "tr" and self.in_body:
            self.row = {"attrs": data, "cells": []}
        elif tag == "td" and self.row is not None:
            self.cell = []
        elif tag == "div" and a.get("id") in ("summary", "routes"):
            self.cards = self.page.summary if a["id"] == "summary" else self.page.routes
        elif tag == "span" and "data-key" in a and self.cards is not None:
            self.span_key = (self.cards, a["data-key"])
            self.cards[a["data-key"]] = ""
        elif tag == "figure" and "data-chart" in a:
            self.chart = Chart({})
            self.page.charts[a["data-chart"]] = self.chart
        elif self.chart is not None:
            if tag == "svg":
                self.chart.svg = data
            elif tag == "path" and "data-series" in a:
                self.chart.lines[a["data-series"]] = {**data, "d": a.get("d", "")}
            elif tag == "line" and "mark" in a.get("class", "").split():
                self.chart.marks.append(data | {"x1": a["x1"], "x2": a["x2"]})
            elif tag == "span" and "data-series" in a:
                self.legend_key = a["data-series"]
                self.chart.legend[self.legend_key] = ""
        if a.get("id") in self.IDS:
            self.page.text[a["id"]] = ""
        if tag not in ("br", "meta", "input", "img"):
            self.id_stack.append(a.get("id") if a.get("id") in self.IDS else None)

    def handle_endtag(self, tag):
        if tag == "table":
            self.table = None
        elif tag == "tbody":
            self.in_body = False
        elif tag == "tr" and self.row is not None:
            if self.table in self.ROWS:
                getattr(self.page, self.ROWS[self.table]).append(self.row)
            elif self.table == "latency":
                cells = self.row["cells"]
                self.page.latency[cells[0]] = cells[1:]
            self.row = None
        elif tag == "td" and self.cell is not None:
            self.row["cells"].append("".join(self.cell).strip())
            self.cell = None
        elif tag == "span":
            self.span_key = None
            self.legend_key = None
        elif tag == "div" and self.span_key is None:
            self.cards = None
        elif tag == "figure":
            self.chart = None
        if tag not in ("br", "meta", "input", "img") and self.id_stack:
            self.id_stack.pop()

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)
        if self.span_key is not None:
            where, key = self.span_key
            where[key] += data
        if self.legend_key is not None and self.chart is not None:
            self.chart.legend[self.legend_key] += data
        for i in self.id_stack:
            if i is not None:
                self.page.text[i] += data


def read_dom(html: str) -> Page:
    r = _DomReader()
    r.feed(html)
    return r.page


# ---- the pool ---------------------------------------------------------------------------------


@dataclass
class Pool:
    base: str
    expected: dict[str, str]  # worker id -> state
    completed: int
    drained: str  # the decode worker that drains (a long request keeps it draining)
    killed: str  # the decode worker killed mid-stream: its request migrates
    # What happened when, by wall clock: (worker, event) -> (before it, once the controller
    # showed it); the marks must fall in between.
    events: dict[tuple[str, str], tuple[float, float]]
    last_request: float  # when the last request ended


def _post(url: str, body: dict, timeout: float = 30.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _states(base: str) -> dict[str, str]:
    return {w["id"]: w["state"] for w in get_json(base + "/pd/workers")}


def _wait_for_states(base: str, expected: dict[str, str], timeout: float, what: str,
                     procs: list[Proc]) -> None:
    seen: list[dict] = []

    def check() -> bool:
        seen[:] = [_states(base)]
        return seen[0] == expected

    try:
        wait_for(check, timeout, what, procs)
    except TimeoutError as e:
        raise TimeoutError(f"{e}: want {expected}, the controller says {seen}") from None


def _fake_worker(wid: str, role: str, wport: int, model: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.fake", "worker", "--role", role, "--controller",
            f"tcp://127.0.0.1:{wport}", "--model", model, "--worker-id", wid,
            "--decode-delay", str(DECODE_DELAY), "--heartbeat-interval", "0.5",
            "--drain-timeout", "600"]


class _Streamer:
    """A streaming completion in a thread; closing it (stop) aborts the request."""

    def __init__(self, base: str, model: str, prompt: list[int], max_tokens: int):
        self.started = threading.Event()
        self.stop = threading.Event()
        self.chunks = 0
        self.finished = False
        self.body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, "stream": True}
        self.base = base
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        req = urllib.request.Request(self.base + "/v1/completions",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps(self.body).encode())
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    if line.startswith(b"data: [DONE]"):
                        self.finished = True
                    elif line.startswith(b"data:"):
                        self.chunks += 1
                        self.started.set()
                    if self.stop.is_set():
                        return  # closing the connection aborts the request
        except OSError:
            pass

    def busy_decode_worker(self, exclude: set[str]) -> str:
        """The decode worker streaming this request (its first token came from the prefill
        worker, before the handoff: wait for the decode leg)."""
        ids: list[str] = []
        seen: list[dict] = []  # the decode workers as last read, for the failure's message

        def found() -> bool:
            seen[:] = [{k: w.get(k) for k in ("id", "state", "inflight")}
                       for w in get_json(self.base + "/pd/workers") if w["role"] == "decode"]
            ids[:] = [w["id"] for w in seen if w["inflight"] > 0 and w["id"] not in exclude]
            return len(ids) == 1 and self.chunks > 2

        try:
            wait_for(found, 60, "the streaming request's decode worker")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; excluding {sorted(exclude)}, the stream had "
                               f"{self.chunks} chunks, the decode workers: {seen}") from None
        return ids[0]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """The scripted timeline: five workers join, a burst, a drain, a kill (with a migration)."""
    from pdserve.models import ensure_model

    chromium()  # no browser: fail before starting anything
    model = str(ensure_model("tiny"))
    logs = tmp_path_factory.mktemp("dashboard-logs")
    port, wport = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    procs: list[Proc] = []
    streams: list[_Streamer] = []
    events: dict[tuple[str, str], tuple[float, float]] = {}
    try:
        t0 = time.time()
        ctl = Proc("controller", pdserve("controller", "--model", model, "--host", "127.0.0.1",
                                         "--port", str(port), "--worker-host", "127.0.0.1",
                                         "--worker-port", str(wport),
                                         # Patient both ways on a loaded machine: a worker
                                         # gives up on the controller after 3 silent intervals
                                         # (6 s), the controller on a worker after 4 (8 s).
                                         "--heartbeat-interval", "2", "--missed-heartbeats", "4",
                                         "--local-prefill-threshold", "0",
                                         "--dashboard-interval", str(SAMPLE_S)), logs)
        procs.append(ctl)
        workers = {wid: Proc(wid, _fake_worker(wid, role, wport, model), logs)
                   for wid, role in WORKERS.items()}
        procs += workers.values()
        _wait_for_states(base, dict.fromkeys(WORKERS, "ready"), 300,
                         "the controller and five fake workers", procs)
        events.update({(wid, "joined"): (t0, time.time()) for wid in WORKERS})

        # A burst of short requests at once.
        burst = [threading.Thread(target=_post, args=(base + "/v1/completions", {
            "model": model, "prompt": [3 + i] * 12, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})) for i in range(BURST)]
        for t in burst:
            t.start()
        for t in burst:
            t.join(120)
        completed = BURST

        # A long request, streaming while its decode worker drains: that worker stays draining.
        # A second one on another decode worker, which is killed: the request migrates.
        streams.append(_Streamer(base, model, [7] * 20, LONG_TOKENS))
        assert streams[0].started.wait(60), "the long streaming request produced no token"
        draining = streams[0].busy_decode_worker(set())
        # Least-loaded routing puts it on an idle decode worker (the registry counts our own
        # streams from its books, not from a load report that can still show the burst).
        migrated = _Streamer(base, model, [9] * 24, MIGRATED_TOKENS)
        streams.append(migrated)
        assert migrated.started.wait(60), "the second streaming request produced no token"
        killed = migrated.busy_decode_worker({draining})
        expected = {wid: "ready" for wid in WORKERS}

        before = time.time()
        workers[draining].signal(signal.SIGTERM)  # drains: waits for the long request
        expected[draining] = "draining"
        _wait_for_states(base, expected, 45, "a draining worker", [ctl])
        events[(draining, "draining")] = (before, time.time())

        before = time.time()
        workers[killed].signal(signal.SIGKILL)  # silent: suspect, then dead (its link is gone)
        expected[killed] = "dead"
        _wait_for_states(base, expected, 90, "a dead worker", [ctl])
        events[(killed, "suspect")] = events[(killed, "dead")] = (before, time.time())
        migrated.thread.join(120)
        assert migrated.finished, "the migrated request did not finish"
        completed += 1

        # Some finished requests, for the latency table (after the kill: /pd/stats covers the
        # last 60 s, and the controller forgets a dead worker 60 s after its last heartbeat).
        for i in range(4):
            r = _post(base + "/v1/completions", {"model": model, "prompt": [5 + i] * (10 + i),
                                                 "max_tokens": 6, "temperature": 0,
                                                 "ignore_eos": True})
            assert len(r["choices"]) == 1, r
            completed += 1
        yield Pool(base, expected, completed, draining, killed, events, time.time())
    finally:
        # The long request ends first (the client goes away: the controller aborts it), so that
        # nothing is in flight when the controller is told to stop.
        for st in streams:
            st.stop.set()
        for st in streams:
            st.thread.join(15)
        for p in procs[1:]:  # the workers, all at once: each takes seconds to exit
            p.signal(signal.SIGTERM)
        for p in reversed(procs):
            p.stop(15)


@dataclass
class Rendered:
    pages: dict[int, Page]  # by window (s)
    # /pd/stats' latency percentiles read just before and just after each window's page was
    # rendered (its 60 s window may slide past a request while chromium runs).
    stats: dict[int, tuple[dict, dict]]
    metrics: dict[tuple[str, frozenset], float]  # /metrics: (name, labels) -> value
    # /metrics just before and just after each window's page, with a history sample between:
    # the page shows the pool as it was at a moment inside that pair (the long request's
    # inter-token gaps go on adding to its histogram).
    around: dict[int, tuple[dict, dict]]
    screenshot: Path


# The series that stay put once the scripted timeline is over. The long request keeps
# streaming: generated tokens, inter-token gaps and its worker's KV usage go on growing, and
# heartbeat ages grow.
SETTLED = ("pdserve_requests_total", "pdserve_retries_total", "pdserve_admission_rejections_total",
           "pdserve_no_worker_rejections_total", "pdserve_local_prefills_total",
           "pdserve_kv_handoff_seconds", "pdserve_time_to_first_token_seconds",
           "pdserve_pool_workers", "pdserve_worker_running_requests",
           "pdserve_worker_waiting_requests")


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    """/metrics: (sample name, labels) -> value, the pdserve_ series."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("pdserve_")}


def settled(values: dict[tuple[str, frozenset], float]) -> dict[tuple[str, frozenset], float]:
    return {k: v for k, v in values.items()
            if k[0] in SETTLED or k[0].rsplit("_", 1)[0] in SETTLED}


def metric(values: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return values.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def rendered(pool, tmp_path_factory) -> Rendered:
    """The page as chromium rendered it, for both windows, with the pool unchanged from before
    to after."""
    tmp = tmp_path_factory.mktemp("browser")
    shot = tmp / "dashboard.png"
    # A sample after the workers' last heartbeats of the last request, so that the charts
    # hold all of it and the per-worker figures have settled.
    def sample_after(t: float, timeout: float, what: str) -> None:
        wait_for(lambda: get_json(pool.base + "/pd/history?window=300")["t"][-1] > t, timeout,
                 what)

    sample_after(pool.last_request + 3, 60, "a sample after the last request")

    def pool_as_json():
        states = _states(pool.base)
        stats = get_json(pool.base + "/pd/stats")
        totals = get_json(pool.base + "/pd/history?window=3600")["totals"]
        return states, stats["in_flight"], totals["completed"], settled(scrape(pool.base))

    before = pool_as_json()
    pages, stats, around = {}, {}, {}
    for window in WINDOWS:
        url = f"{pool.base}/pd/dashboard?window={window}"
        first, metrics_first = get_json(pool.base + "/pd/stats"), scrape(pool.base)
        sample_after(get_json(pool.base + "/pd/history?window=300")["now"], 30,
                     "a history sample after the scrape")
        pages[window] = read_dom(run_chromium(["--dump-dom", url], tmp / "profile"))
        stats[window] = (first, get_json(pool.base + "/pd/stats"))
        around[window] = (metrics_first, scrape(pool.base))
    run_chromium([f"--screenshot={shot}", "--window-size=1280,2900", "--hide-scrollbars",
                  f"{pool.base}/pd/dashboard?window=300"], tmp / "profile")
    after = pool_as_json()
    now = (pool.expected, 1, pool.completed)
    changed = {k: (before[3].get(k), after[3].get(k)) for k in before[3].keys() | after[3].keys()
               if before[3].get(k) != after[3].get(k)}
    assert before[:3] == after[:3] == now and not changed, (
        f"the pool changed around the browser runs (the machine may be too slow): expected "
        f"{now}, JSON before {before[:3]}, after {after[:3]}; metrics that changed: {changed}")
    keep = os.environ.get("PDSERVE_DASHBOARD_SCREENSHOT")  # to look at it
    if keep:
        shutil.copy(shot, keep)
    return Rendered(pages, stats, scrape(pool.base), around, shot)


# ---- tests ------------------------------------------------------------------------------------


def test_page_is_self_contained(pool):
    with urllib.request.urlopen(pool.base + "/pd/dashboard", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/html")
        html = r.read().decode()
    for needle in ("src=\"http", "href=\"http", "src='http", "href='http", "@import", "url("):
        assert needle not in html, f"the page loads an external asset ({needle})"


def test_browser_renders_the_pool(pool, rendered):
    page = rendered.pages[300]
    assert page.text.get("err", "") == "", page.text["err"]
    assert page.text.get("updated", "").startswith("updated"), "the page's script did not run"

    # One row per worker, with its role and state.
    rows = {r["cells"][0]: r for r in page.worker_rows}
    assert len(page.worker_rows) == len(WORKERS) == len(rows), page.worker_rows
    for wid, state in pool.expected.items():
        attrs = rows[wid]["attrs"]
        assert attrs == {"data-role": WORKERS[wid], "data-state": state}, (wid, attrs)
        cells = rows[wid]["cells"]
        assert cells[1:3] == [WORKERS[wid], state], (wid, cells)
        assert cells[3].startswith("127.0.0.1:"), cells
        assert cells[7].endswith("%"), cells  # KV usage
        float(cells[8])  # heartbeat age
    assert rows[pool.drained]["cells"][6] == "1", rows[pool.drained]  # the long request

    # The summary cards count workers per role and state.
    expected_counts = Counter(f"{WORKERS[w]} {s}" for w, s in pool.expected.items())
    assert expected_counts == Counter({"prefill ready": 2, "decode ready": 1,
                                       "decode draining": 1, "decode dead": 1})
    assert page.summary == {k: f"{k}: {n}" for k, n in expected_counts.items()}, page.summary

    # Latency percentiles of the finished requests, and the request rate line.
    assert list(page.latency) == ["TTFT (ms)", "TPOT (ms)", "end to end (s)"], page.latency
    for label, values in page.latency.items():
        assert len(values) == 3, (label, values)
        nums = [float(v) for v in values]  # "-" (no data) would fail here
        assert all(v >= 0 for v in nums), (label, values)
        assert nums == sorted(nums), (label, values)  # p50 <= p90 <= p99
    # They are the controller's own figures (/pd/stats), in the page's units. The values
    # themselves depend on timing (a 4-token request's TPOT is a fraction of a decode step).
    shown = {label: [float(v) for v in values] for label, values in page.latency.items()}
    assert any(_shows(shown, s) for s in rendered.stats[300]), (shown, rendered.stats[300])
    assert page.text["window"] == "60", page.text
    rate = page.text["rate"]  # the last 60 s: at least the completions after the kill
    completed = re.search(r"completed (\d+)", rate)
    assert completed and 4 <= int(completed[1]) <= pool.completed, rate
    assert "1 in flight" in rate, rate


def _shows(shown: dict[str, list[float]], stats: dict) -> bool:
    """Whether the latency table shows /pd/stats' percentiles (to the 0.1 ms or 0.01 s shown)."""
    for name, label, scale, half in (("ttft", "TTFT (ms)", 1e3, 0.05),
                                     ("tpot", "TPOT (ms)", 1e3, 0.05),
                                     ("e2e", "end to end (s)", 1.0, 0.005)):
        want = [stats[name][q] * scale for q in ("p50", "p90", "p99")]
        if any(abs(a - b) > half + 1e-9 for a, b in zip(shown[label], want)):
            return False
    return True


CHARTS = ["outcomes", "routes", "ttft", "itl", "handoff", "sequences", "running", "waiting",
          "kv_usage"]


def axes(chart: Chart) -> dict[str, float]:
    return {k: float(v) for k, v in chart.svg.items() if k != "data-times"}


@pytest.mark.parametrize("window", WINDOWS)
def test_charts_exist_with_their_points(rendered, window):
    page = rendered.pages[window]
    assert list(page.charts) == CHARTS
    step = {300: SAMPLE_S, 3600: 12 * SAMPLE_S}[window]  # at most 300 points
    assert page.text["step"] == f"one point per {step} s, a sample every {SAMPLE_S} s"
    for key, chart in page.charts.items():
        svg = axes(chart)
        times = json.loads(chart.svg["data-times"])
        # The window, or since the controller started (under 5 min ago here).
        assert svg["data-t1"] - svg["data-t0"] < min(window, 300), key
        assert svg["data-step"] == step and 3 <= len(times) <= 300, (key, len(times))
        assert all(svg["data-t0"] < t <= svg["data-t1"] for t in times), key
        assert chart.lines, f"chart {key} has no line"
        for name, line in chart.lines.items():
            values = json.loads(line["data-values"])
            assert len(values) == len(times), (key, name)
            # Each value is drawn where the axes put it: x by its step's end, y by its value.
            points = [tuple(map(float, p.split(","))) for p in
                      line["d"].replace("M", " ").replace("L", " ").replace("l0,0", " ").split()]
            drawn = [(t, v) for t, v in zip(times, values) if v is not None]
            assert len(points) == len(drawn), (key, name)
            for (x, y), (t, v) in zip(points, drawn):
                want_x = svg["data-left"] + svg["data-width"] * (
                    (t - svg["data-t0"]) / (svg["data-t1"] - svg["data-t0"]))
                want_y = svg["data-top"] + svg["data-height"] * (1 - v / svg["data-ymax"])
                assert (x, y) == (pytest.approx(want_x, abs=0.06),
                                  pytest.approx(want_y, abs=0.06)), (key, name, t, v)
    workers = {name for name in page.charts["running"].lines}
    assert workers == set(WORKERS)


def test_points_match_the_metrics(pool, rendered):
    """Over the hour (the whole life of the controller), the points add up to /metrics."""
    from pdserve.controller.history import quantile

    page, m = rendered.pages[3600], rendered.metrics
    step = float(page.charts["outcomes"].svg["data-step"])

    def total(chart: str, series: str) -> float:
        return sum(v * step for v in json.loads(page.charts[chart].lines[series]["data-values"])
                   if v is not None)

    counters = {
        ("outcomes", "completed"): metric(m, "pdserve_requests_total", outcome="completed"),
        ("outcomes", "failed"): metric(m, "pdserve_requests_total", outcome="failed"),
        ("outcomes", "aborted"): metric(m, "pdserve_requests_total", outcome="aborted"),
        ("outcomes", "retried"): metric(m, "pdserve_retries_total", kind="prefill_retry"),
        ("outcomes", "migrated"): metric(m, "pdserve_retries_total", kind="migration"),
        ("outcomes", "refused"): sum(v for (n, _), v in m.items()
                                     if n == "pdserve_admission_rejections_total"),
        ("routes", "local"): metric(m, "pdserve_local_prefills_total"),
        ("routes", "handoff"): metric(m, "pdserve_kv_handoff_seconds_count"),
    }
    for (chart, series), value in counters.items():
        assert total(chart, series) == pytest.approx(value), (chart, series)
        legend = page.charts[chart].legend[series]
        assert legend.endswith(f": {value:g}"), (chart, series, legend)
    assert counters[("outcomes", "completed")] == pool.completed
    assert counters[("outcomes", "migrated")] >= 1  # the killed worker's request
    assert counters[("routes", "handoff")] >= pool.completed  # every request was disaggregated
    assert page.routes["handoff"].startswith(f"KV handoffs: {counters[('routes', 'handoff')]:g}")
    assert page.routes["local"] == "local prefills: 0 (0%)"

    # Latency over the whole window: histogram_quantile of the /metrics buckets, shown to 0.1 ms
    # and within half of that (the page's figure comes from the history's bucket deltas, whose
    # float sums can put it on the other side of a rounding). The inter-token histogram goes on
    # growing with the long request: its figure lies between those of the scrapes around the
    # page, give or take 1% (its gaps fall in one bucket or two, so the quantile moves little
    # and mostly one way between them: a run saw 49.3 shown beside 49.245 and 49.247).
    def ms(q: str, metrics: dict, series: str) -> float:
        rows = sorted((float(dict(labels)["le"]), v) for (n, labels), v in metrics.items()
                      if n == series + "_bucket")
        got = quantile(int(q[1:]) / 100, [le for le, _ in rows], [v for _, v in rows])
        assert got is not None and got > 0, (series, q)
        return got * 1000

    for chart, series in (("ttft", "pdserve_time_to_first_token_seconds"),
                          ("itl", "pdserve_inter_token_latency_seconds"),
                          ("handoff", "pdserve_kv_handoff_seconds")):
        for q in ("p50", "p99"):
            legend = page.charts[chart].legend[q]
            shown = re.fullmatch(rf"{q}: ([0-9.]+) ms over the window", legend)
            assert shown, legend
            scrapes = rendered.around[3600] if chart == "itl" else (m,)
            figures = [ms(q, scraped, series) for scraped in scrapes]
            slack = 0.05 + 1e-9 + (0.01 * max(figures) if chart == "itl" else 0.0)
            assert min(figures) - slack <= float(shown[1]) <= max(figures) + slack, (
                chart, q, legend, figures)

    # Per worker: the last point is what /metrics says now (nothing changed since, but the KV
    # usage of the worker that streams the long request).
    for chart, series, scale in (("running", "pdserve_worker_running_requests", 1),
                                 ("waiting", "pdserve_worker_waiting_requests", 1),
                                 ("kv_usage", "pdserve_worker_kv_usage_ratio", 100)):
        for wid, role in WORKERS.items():
            if chart == "kv_usage" and wid == pool.drained:
                continue
            values = json.loads(page.charts[chart].lines[wid]["data-values"])
            last = next(v for v in reversed(values) if v is not None)
            assert last == pytest.approx(metric(m, series, worker=wid, role=role) * scale,
                                         abs=1e-2), (chart, wid)
    running = json.loads(page.charts["running"].lines[pool.drained]["data-values"])
    assert running[-1] == 1  # the long request


@pytest.mark.parametrize("window", WINDOWS)
def test_membership_marks_are_where_the_events_happened(pool, rendered, window):
    page = rendered.pages[window]
    for key, chart in page.charts.items():
        svg = axes(chart)
        seen = {(mk["data-worker"], mk["data-event"]): mk for mk in chart.marks}
        # All of them (the joins too, unless the machine took over 5 min to get here).
        expected = {e for e, (_, after) in pool.events.items() if after > svg["data-t0"]}
        assert set(seen) == expected and len(chart.marks) == len(seen), key
        assert {(pool.drained, "draining"), (pool.killed, "dead")} <= expected
        for (wid, event), mk in seen.items():
            before, after = pool.events[(wid, event)]
            t = float(mk["data-t"])
            assert before <= t <= after, (key, wid, event, before, t, after)
            x = svg["data-left"] + svg["data-width"] * (
                (t - svg["data-t0"]) / (svg["data-t1"] - svg["data-t0"]))
            assert float(mk["x1"]) == float(mk["x2"]) == pytest.approx(x, abs=0.06), (key, wid)
    # The same changes, newest first, in the table under the charts.
    rows = [(r["attrs"]["data-worker"], r["attrs"]["data-event"]) for r in page.events]
    assert sorted(rows) == sorted(seen)
    assert rows[0] == (pool.killed, "dead") and rows[1] == (pool.killed, "suspect")


def test_failures_show_their_reason_and_worker(pool, rendered):
    page = rendered.pages[300]
    rows = [r for r in page.failures if r["attrs"]]
    assert rows, page.failures
    kinds = Counter(r["attrs"]["data-kind"] for r in rows)
    assert kinds == {"migration": metric(rendered.metrics, "pdserve_retries_total",
                                         kind="migration")}, kinds
    for r in rows:
        assert r["attrs"]["data-worker"] == pool.killed, r
        when, what, worker, reason = r["cells"]
        assert (what, worker) == ("migrated", pool.killed), r
        assert f"worker {pool.killed} lost" in reason, reason


def test_screenshot_is_taken(rendered):
    data = rendered.screenshot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, len(data)
