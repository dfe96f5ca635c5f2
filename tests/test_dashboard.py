"""The pool page (GET /pd/dashboard) in a real headless browser, Debian's chromium.

A real controller (`pdserve controller`, vLLM's OpenAI server) runs with five fake workers in
their own processes (`python -m pdserve.fake worker`): two prefill, three decode. One decode
worker is drained while a long request still streams through it (it stays "draining"), one prefill
worker is killed with SIGKILL (it turns "dead" once its heartbeats stop), and a few completions
give the latency table something to show. Chromium loads the page, runs its script and dumps the
DOM it rendered; the tests check the rendered worker table, the summary counts and the latency
table, and a screenshot is taken (PDSERVE_DASHBOARD_SCREENSHOT=file.png keeps a copy).
Without chromium the tests fail (scripts/test.sh installs it when run as root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
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
class Page:
    """What the browser rendered, read from the dumped DOM."""

    worker_rows: list[dict] = field(default_factory=list)  # data-* attributes + cell texts
    summary: dict[str, str] = field(default_factory=dict)  # data-key -> text
    latency: dict[str, list[str]] = field(default_factory=dict)  # metric label -> p50/p90/p99
    text: dict[str, str] = field(default_factory=dict)  # id -> text of a few elements


class _DomReader(HTMLParser):
    IDS = ("err", "rate", "updated", "window")

    def __init__(self):
        super().__init__()
        self.page = Page()
        self.table: str | None = None  # id of the table we are in
        self.in_body = False
        self.row: dict | None = None
        self.cell: list[str] | None = None
        self.span_key: str | None = None
        self.id_stack: list[str | None] = []  # text collectors for IDS

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.table = a.get("id")
        elif tag == "tbody":
            self.in_body = True
        elif tag == "tr" and self.in_body:
            self.row = {"attrs": {k: v for k, v in a.items() if k.startswith("data-")},
                        "cells": []}
        elif tag == "td" and self.row is not None:
            self.cell = []
        elif tag == "span" and "data-key" in a:
            self.span_key = a["data-key"]
            self.page.summary[self.span_key] = ""
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
            if self.table == "workers":
                self.page.worker_rows.append(self.row)
            elif self.table == "latency":
                cells = self.row["cells"]
                self.page.latency[cells[0]] = cells[1:]
            self.row = None
        elif tag == "td" and self.cell is not None:
            self.row["cells"].append("".join(self.cell).strip())
            self.cell = None
        elif tag == "span":
            self.span_key = None
        if tag not in ("br", "meta", "input", "img") and self.id_stack:
            self.id_stack.pop()

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)
        if self.span_key is not None:
            self.page.summary[self.span_key] += data
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


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from pdserve.models import ensure_model

    chromium()  # no browser: fail before starting anything
    model = str(ensure_model("tiny"))
    logs = tmp_path_factory.mktemp("dashboard-logs")
    port, wport = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    procs: list[Proc] = []
    stream_stop = threading.Event()
    streamer = None
    try:
        ctl = Proc("controller", pdserve("controller", "--model", model, "--host", "127.0.0.1",
                                         "--port", str(port), "--worker-host", "127.0.0.1",
                                         "--worker-port", str(wport),
                                         # Patient both ways on a loaded machine: a worker
                                         # gives up on the controller after 3 silent intervals
                                         # (6 s), the controller on a worker after 4 (8 s).
                                         "--heartbeat-interval", "2", "--missed-heartbeats", "4",
                                         "--local-prefill-threshold", "0"), logs)
        procs.append(ctl)
        workers = {wid: Proc(wid, _fake_worker(wid, role, wport, model), logs)
                   for wid, role in WORKERS.items()}
        procs += workers.values()
        _wait_for_states(base, dict.fromkeys(WORKERS, "ready"), 300,
                         "the controller and five fake workers", procs)

        # A long request, streaming while its decode worker drains: that worker stays draining.
        started = threading.Event()

        def stream():
            req = urllib.request.Request(
                base + "/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"model": model, "prompt": [7] * 20, "max_tokens": LONG_TOKENS,
                                 "temperature": 0, "ignore_eos": True,
                                 "stream": True}).encode())
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    for _ in r:
                        started.set()
                        if stream_stop.is_set():
                            return  # closing the connection aborts the request
            except OSError:
                pass

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        assert started.wait(60), "the long streaming request produced no token"
        busy = [w["id"] for w in get_json(base + "/pd/workers")
                if w["role"] == "decode" and w["inflight"] > 0]
        assert len(busy) == 1, get_json(base + "/pd/workers")
        draining, dead = busy[0], "prefill-b"
        workers[draining].signal(signal.SIGTERM)  # drains: waits for the long request
        workers[dead].signal(signal.SIGKILL)  # silent: the controller marks it dead
        expected = {wid: "ready" for wid in WORKERS}
        expected.update({draining: "draining", dead: "dead"})
        _wait_for_states(base, expected, 45, "a draining and a dead worker", [ctl])

        # Some finished requests, for the latency table (after the kill: /pd/stats covers the
        # last 60 s, and the controller forgets a dead worker 60 s after its last heartbeat).
        completed = 0
        for i in range(4):
            r = _post(base + "/v1/completions", {"model": model, "prompt": [5 + i] * (10 + i),
                                                 "max_tokens": 6, "temperature": 0,
                                                 "ignore_eos": True})
            assert len(r["choices"]) == 1, r
            completed += 1
        yield Pool(base, expected, completed)
    finally:
        # The long request ends first (the client goes away: the controller aborts it), so that
        # nothing is in flight when the controller is told to stop.
        stream_stop.set()
        if streamer is not None:
            streamer.join(15)
        for p in procs[1:]:  # the workers, all at once: each takes seconds to exit
            p.signal(signal.SIGTERM)
        for p in reversed(procs):
            p.stop(15)


@dataclass
class Rendered:
    page: Page
    screenshot: Path


@pytest.fixture(scope="module")
def rendered(pool, tmp_path_factory) -> Rendered:
    """The page as chromium rendered it, with the pool unchanged from before to after."""
    tmp = tmp_path_factory.mktemp("browser")
    shot = tmp / "dashboard.png"

    def pool_as_json():
        states = _states(pool.base)
        stats = get_json(pool.base + "/pd/stats")
        return states, stats["by_outcome"], stats["in_flight"]

    before = pool_as_json()
    dom = run_chromium(["--dump-dom", pool.base + "/pd/dashboard"], tmp / "profile")
    run_chromium([f"--screenshot={shot}", "--window-size=1200,900", "--hide-scrollbars",
                  pool.base + "/pd/dashboard"], tmp / "profile")
    after = pool_as_json()
    now = (pool.expected, {"completed": pool.completed}, 1)
    assert before == after == now, (
        f"the pool changed around the browser runs (the machine may be too slow): expected "
        f"{now}, JSON before {before}, after {after}")
    keep = os.environ.get("PDSERVE_DASHBOARD_SCREENSHOT")  # to look at it
    if keep:
        shutil.copy(shot, keep)
    return Rendered(read_dom(dom), shot)


# ---- tests ------------------------------------------------------------------------------------


def test_page_is_self_contained(pool):
    with urllib.request.urlopen(pool.base + "/pd/dashboard", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/html")
        html = r.read().decode()
    for needle in ("src=\"http", "href=\"http", "src='http", "href='http", "@import", "url("):
        assert needle not in html, f"the page loads an external asset ({needle})"


def test_browser_renders_the_pool(pool, rendered):
    page = rendered.page
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
    draining = next(w for w, s in pool.expected.items() if s == "draining")
    assert rows[draining]["cells"][6] == "1", rows[draining]  # the long request, in flight

    # The summary cards count workers per role and state.
    expected_counts = Counter(f"{WORKERS[w]} {s}" for w, s in pool.expected.items())
    assert expected_counts == Counter({"prefill ready": 1, "prefill dead": 1,
                                       "decode ready": 2, "decode draining": 1})
    assert page.summary == {k: f"{k}: {n}" for k, n in expected_counts.items()}, page.summary

    # Latency percentiles of the finished requests, and the request rate line.
    assert list(page.latency) == ["TTFT (ms)", "TPOT (ms)", "end to end (s)"], page.latency
    for label, values in page.latency.items():
        assert len(values) == 3, (label, values)
        nums = [float(v) for v in values]  # "-" (no data) would fail here
        assert all(v > 0 for v in nums), (label, values)
        assert nums == sorted(nums), (label, values)  # p50 <= p90 <= p99
    tpot_ms = [float(v) for v in page.latency["TPOT (ms)"]]
    assert tpot_ms[0] >= 1000 * DECODE_DELAY * 0.5, tpot_ms  # the fake decode delay shows
    assert page.text["window"] == "60", page.text
    rate = page.text["rate"]
    assert f"completed {pool.completed}" in rate and "1 in flight" in rate, rate


def test_screenshot_is_taken(rendered):
    data = rendered.screenshot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, len(data)
