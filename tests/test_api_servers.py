"""Several controllers over one pool, as processes: `pdserve controller --api-servers 2` (two API
servers on one HTTP port) and a controller replaced by another while requests flow. The
controllers are real (vLLM's server on the tiny model's tokenizer, no engine); the workers are
fake (pdserve.fake: deterministic tokens, --decode-delay between them), so no engine starts.

The first three tests share one controller and its two workers and run in order: both API
servers see both workers and answer alike; kill -9 of one API server (its clients get a
connection error, the other's streams go on, the workers free its legs, it is started again and
the workers register with it); SIGTERM to the controller (every stream finishes, each API server
tells the workers it leaves). The workers are also given a controllers file, empty until the
last test, which replaces one of two controllers under load.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import Proc, children, free_port, free_ports, pdserve, wait_for

PROMPT = list(range(300, 340))  # token ids: the fake engine's answer is known in advance
TOKENS = 30  # a stream takes ~3 s at DECODE_DELAY
DECODE_DELAY = 0.1
DEAD_AFTER = 3  # the controller's: workers drop a silent controller's legs after it
LONG = 100  # tokens: streams that outlast DEAD_AFTER
SHUTDOWN_TIMEOUT = 20
START = 240  # seconds: controllers import vLLM, on two cores shared with others
HEADER = "x-pdserve-controller"
REGISTERED = re.compile(r"pdserve controller (controller-[0-9a-f]+): workers register at "
                        r"tcp://[^:]+:(\d+)")


def reference_text(max_tokens: int) -> str:
    from vllm import SamplingParams

    from pdserve import fake

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return fake.reference(PROMPT, params).text


@dataclass
class Answer:
    """One streamed completion as its client saw it."""

    max_tokens: int = TOKENS
    controller: str = ""  # the x-pdserve-controller that answered
    status: int = 0
    retry_after: str | None = None
    text: str = ""
    tokens: int | None = None  # usage.completion_tokens
    finish: str | None = None
    done: bool = False  # "data: [DONE]" arrived
    error: str | None = None  # the connection failed (before or after the status line)
    sent: float = 0.0  # monotonic times: the request sent, its status line, its end
    started: float = 0.0
    ended: float = 0.0

    def whole(self, reference: str) -> bool:
        return (self.status == 200 and self.error is None and self.done
                and self.finish == "length" and self.tokens == self.max_tokens
                and self.text == reference)

    @property
    def refused(self) -> bool:
        """Turned away before it started, so safe to send elsewhere: no connection, no answer,
        or a 503 with Retry-After (a draining controller)."""
        return (self.status == 0 and self.error is not None) or (
            self.status == 503 and self.retry_after is not None)


def stream(port: int, a: Answer, on_status: Callable[[Answer], None] = lambda a: None) -> Answer:
    """A streamed completion of PROMPT on a new connection, into `a`."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": a.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    a.sent = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        a.status, a.controller = r.status, r.getheader(HEADER, "")
        a.retry_after, a.started = r.getheader("Retry-After"), time.monotonic()
        on_status(a)
        if r.status != 200:
            r.read()
            return a
        for line in r:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                a.done = True
                continue
            chunk = json.loads(data)
            for c in chunk.get("choices") or ():
                a.text += c.get("text") or ""
                a.finish = c.get("finish_reason") or a.finish
            if chunk.get("usage"):
                a.tokens = chunk["usage"]["completion_tokens"]
        if not a.done:  # http.client ends a chunked body cut short without a word
            a.error = "the connection closed before the end of the stream"
    except (OSError, http.client.HTTPException) as e:
        a.error = f"{type(e).__name__}: {e}"
    finally:
        a.ended = time.monotonic()
        conn.close()
        on_status(a)
    return a


def complete(port: int) -> tuple[str, str]:
    """A whole (not streamed) completion of PROMPT: (controller, text)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        out = json.loads(r.read())
        assert r.status == 200, out
        return r.getheader(HEADER, ""), out["choices"][0]["text"]
    finally:
        conn.close()


def pool_view(port: int) -> tuple[str, list[dict]]:
    """(the controller that answered, its /pd/workers), on a new connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/pd/workers")
        r = conn.getresponse()
        return r.getheader(HEADER, ""), json.loads(r.read())
    finally:
        conn.close()


def wait_views(port: int, want: Callable[[dict[str, list[dict]]], bool], what: str,
               procs: list[Proc] = (), timeout: float = START) -> dict[str, list[dict]]:
    """Ask the port (new connections reach each API server behind it in turn) until the views
    of the controllers that answered satisfy `want`; returns them, by controller."""
    views: dict[str, list[dict]] = {}

    def look() -> bool:
        controller, workers = pool_view(port)
        views[controller] = workers
        return want(views)

    wait_for(look, timeout, what, procs)
    return views


def both_ready(workers: list[dict]) -> bool:
    return sorted(w["role"] for w in workers if w["state"] == "ready") == ["decode", "prefill"]


def open_streams(port: int, controllers: set[str], each: int = 2, limit: int = 40,
                 max_tokens: int = TOKENS) -> tuple[list[Answer], list[threading.Thread]]:
    """Streams, each on a new connection, until every controller named holds `each` of them."""
    answers: list[Answer] = []
    threads: list[threading.Thread] = []
    while any(sum(a.controller == c for a in answers) < each for c in controllers):
        assert len(answers) < limit, [a.controller for a in answers]
        a, answered = Answer(max_tokens), threading.Event()
        t = threading.Thread(target=stream, args=(port, a, lambda _: answered.set()), daemon=True)
        t.start()
        assert answered.wait(60), "no answer to a stream"
        assert a.status == 200, a
        answers.append(a)
        threads.append(t)
    return answers, threads


def controller_ids(log: str) -> dict[int, str]:
    """The latest controller id of each worker port, from a controller's log."""
    return {int(port): cid for cid, port in REGISTERED.findall(log)}


def fake_worker(role: str, model: str, logs: Path, *sources: str) -> Proc:
    return Proc(f"{role}-worker", [sys.executable, "-m", "pdserve.fake", "worker", "--role", role,
                                   "--model", model, "--worker-id", f"{role}-1",
                                   "--decode-delay", str(DECODE_DELAY), *sources], logs)


def controller(name: str, model: str, logs: Path, port: int, worker_port: int,
               *extra: str) -> Proc:
    return Proc(name, pdserve("controller", "--model", model, "--served-model-name", "tiny",
                              "--host", "127.0.0.1", "--port", str(port), "--worker-port",
                              str(worker_port), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                              "--disable-uvicorn-access-log", *extra), logs)


@dataclass
class Front:
    port: int
    worker_port: int
    parent: Proc
    workers: list[Proc]
    controllers_file: Path
    model: str
    logs: Path
    reference: str


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    from pdserve.models import ensure_model

    logs = tmp_path_factory.mktemp("api-servers")
    model = str(ensure_model("tiny"))
    port, wport = free_port(), free_ports(2)
    listing = logs / "controllers"
    listing.write_text("")
    parent = controller("controller", model, logs, port, wport, "--api-servers", "2",
                        "--dead-after", str(DEAD_AFTER))
    # Given only the first API server's worker port: it names the second in its acks.
    workers = [fake_worker(role, model, logs, "--controller", f"tcp://127.0.0.1:{wport}",
                           "--controllers-file", str(listing)) for role in ("prefill", "decode")]
    procs = [parent, *workers]
    try:
        wait_views(port, lambda v: len(v) == 2 and all(map(both_ready, v.values())),
                   "both API servers to see both workers", procs)
        yield Front(port, wport, parent, workers, listing, model, logs, reference_text(TOKENS))
    finally:
        for p in procs:
            p.stop()


def test_both_api_servers_serve_the_whole_pool_alike(front: Front) -> None:
    ids = set(controller_ids(front.parent.log()).values())
    assert len(ids) == 2
    views = wait_views(front.port, lambda v: set(v) == ids, "an answer from each API server")
    for workers in views.values():
        assert both_ready(workers)
        assert len({w["pid"] for w in workers}) == 2
    answered: dict[str, str] = {}
    wait_for(lambda: answered.update([complete(front.port)]) or set(answered) == ids, 60,
             "a completion from each API server")
    assert set(answered.values()) == {front.reference}
    answers, threads = open_streams(front.port, ids, each=1)
    for t in threads:
        t.join(60)
    assert all(a.whole(front.reference) for a in answers), answers


def test_an_idle_connection_stays_open_past_vllms_keep_alive_for_its_next_request(
        front: Front) -> None:
    # Clients reuse an idle connection for seconds after vLLM's default 5 s (aiohttp 15 s): a
    # server that closed it meanwhile would fail the request sent on it (net.KEEP_ALIVE_S).
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    try:
        conn.request("GET", "/pd/workers")
        assert conn.getresponse().read() and conn.sock is not None
        first = conn.sock
        time.sleep(6.0)
        first.setblocking(False)
        try:
            assert first.recv(1, socket.MSG_PEEK) != b"", "the server closed the connection"
        except BlockingIOError:
            pass  # open, and nothing to read: as it should be
        first.setblocking(True)
        conn.request("GET", "/pd/workers")
        r = conn.getresponse()
        assert r.status == 200 and r.read() and conn.sock is first  # the same connection
    finally:
        conn.close()


def test_a_killed_api_server_loses_only_its_own_streams_and_comes_back(front: Front) -> None:
    by_port = controller_ids(front.parent.log())
    victim_port = front.worker_port + 1
    victim, other = by_port[victim_port], by_port[front.worker_port]
    answers, threads = open_streams(front.port, {victim, other}, max_tokens=LONG)
    # Each on its decode worker (past the prefill's first token) when the kill comes.
    wait_for(lambda: all(len(a.text.split()) >= 3 for a in answers), 30, "decoding streams")
    [pid] = [p for p, cmd in children(front.parent.pid).items()
             if "--api-server-index 1" in cmd]
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    for a in answers:
        if a.controller == victim:  # a clean connection error, never a short "finished" answer
            assert a.error is not None and not a.done and a.finish is None, a
        else:
            assert a.whole(reference_text(LONG)), a
    # Started again by the parent (after its backoff); the workers register with it again.
    wait_for(lambda: controller_ids(front.parent.log())[victim_port] != victim, START,
             "the API server to be started again", [front.parent])
    reborn = controller_ids(front.parent.log())[victim_port]
    wait_views(front.port, lambda v: reborn in v and both_ready(v[reborn]),
               "the restarted API server to see both workers", [front.parent])
    # The decode worker freed the killed one's legs once it had been silent for its dead-after
    # (long before its streams would have ended): nothing runs on either worker. (Their KV
    # usage is no witness here: a fake prefill engine in another process than its decode
    # engine never learns that its blocks were read, and holds them until a timeout.)
    decode_log = next(w for w in front.workers if w.name.startswith("decode")).log()
    freed = re.search(rf"controller tcp://127.0.0.1:{victim_port} silent for \d+ s: aborting "
                      r"its (\d+) requests", decode_log)
    assert freed and int(freed[1]) == sum(a.controller == victim for a in answers), \
        decode_log[-3000:]
    wait_for(lambda: all(w["running"] == 0 and w["inflight"] == 0
                         for w in pool_view(front.port)[1]), 60, "idle workers")


def test_sigterm_lets_every_api_servers_streams_finish(front: Front) -> None:
    ids = set(wait_views(front.port, lambda v: len(v) >= 2 and all(map(both_ready, v.values())),
                         "both API servers").keys())
    live = set(controller_ids(front.parent.log()).values()) & ids
    assert len(live) == 2, (ids, live)
    answers, threads = open_streams(front.port, live)
    os.kill(front.parent.pid, signal.SIGTERM)  # the parent passes it on to each API server
    time.sleep(1)
    late = stream(front.port, Answer())  # the port is closing: turned away, retryable
    assert late.refused, late
    for t in threads:
        t.join(60)
    assert all(a.whole(front.reference) for a in answers), answers
    assert front.parent.proc.wait(SHUTDOWN_TIMEOUT + 30) == 0
    for w in front.workers:
        for cid in live:
            wait_for(lambda: f"({cid}) is leaving (controller shutting down): aborting its 0 "
                     "requests" in w.log(), 30, f"{w.name} to hear {cid} leave")


# --- a rollout: one controller replaced by another while requests flow ---------------------


@dataclass
class Site:
    name: str
    port: int
    worker_port: int
    proc: Proc


class Clients:
    """Client threads sending streams round-robin to the live controllers; a request turned
    away (no connection, or 503 with Retry-After) is sent again to the next controller."""

    def __init__(self, live: list[Site], n: int, max_tokens: int):
        self.live = live  # changed by the test as controllers come and go
        self.max_tokens = max_tokens
        self.turn = itertools.count()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.requests: list[list[tuple[str, Answer]]] = []  # each request: its attempts
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _run(self) -> None:
        while not self.stop.is_set():
            attempts: list[tuple[str, Answer]] = []
            with self.lock:
                self.requests.append(attempts)
            for _ in range(10):
                live = list(self.live)  # the test changes it meanwhile
                site = live[next(self.turn) % len(live)]
                a = Answer(max_tokens=self.max_tokens)
                attempts.append((site.name, a))
                stream(site.port, a)
                if not a.refused:
                    break

    def in_flight_on(self, name: str) -> bool:
        with self.lock:
            return any(s == name and a.status == 200 and not a.ended
                       for attempts in self.requests for s, a in attempts)


def test_a_controller_replaced_under_load_loses_no_request(front: Front, capsys) -> None:
    model, logs = front.model, front.logs
    sites: dict[str, Site] = {}
    reference = reference_text(10)

    def start(name: str) -> Site:
        port, wport = free_port(), free_port()
        sites[name] = Site(name, port, wport,
                           controller(f"rollout-{name}", model, logs, port, wport))
        return sites[name]

    def listing(*names: str) -> None:
        front.controllers_file.write_text(
            "".join(f"tcp://127.0.0.1:{sites[n].worker_port}\n" for n in names))

    def ready(site: Site) -> None:
        wait_views(site.port, lambda v: any(map(both_ready, v.values())),
                   f"controller {site.name} to see both workers", [site.proc])

    try:
        a, b = start("A"), start("B")
        listing("A", "B")
        ready(a)
        ready(b)
        live = [a, b]
        with Clients(live, n=4, max_tokens=10) as clients:
            time.sleep(3)
            a2 = start("A2")
            listing("A", "B", "A2")
            ready(a2)
            a2_up = time.monotonic()
            live.append(a2)
            wait_for(lambda: clients.in_flight_on("A"), 30, "a stream in flight on A")
            a.proc.signal(signal.SIGTERM)
            sigterm = time.monotonic()
            listing("B", "A2")
            assert a.proc.proc.wait(SHUTDOWN_TIMEOUT + 30) == 0
            live.remove(a)  # clients sent to A until it had gone: those were turned away
            time.sleep(3)
    finally:
        for s in sites.values():
            s.proc.stop()

    attempts = [x for r in clients.requests for x in r]
    turned_away = [(s, x) for s, x in attempts if x.refused]
    finished = [r for r in clients.requests if r and r[-1][1].whole(reference)]
    unfinished = [r for r in clients.requests if r and not r[-1][1].ended]  # stopped mid-way
    failed = [r for r in clients.requests
              if r and r[-1][1].ended and not r[-1][1].whole(reference)]
    started = [x for s, x in attempts if x.status == 200]
    with capsys.disabled():
        print(f"\nrollout: {len(clients.requests)} requests, {len(started)} started, "
              f"{len(finished)} finished, {len(failed)} failed; {len(turned_away)} attempts "
              f"refused, retryable ({sum(x.status == 503 for _, x in turned_away)} 503 with "
              f"Retry-After, {sum(x.status == 0 for _, x in turned_away)} no connection), "
              "each sent again to another controller")
    assert not unfinished
    assert failed == [], failed
    on_a = [x for s, x in attempts if s == "A" and x.status == 200 and x.started < sigterm]
    assert on_a and all(x.whole(reference) for x in on_a)
    assert any(x.ended > sigterm for x in on_a)  # one at least drained through the SIGTERM
    # Only A turned requests away, and only once it had been told to stop.
    assert all(s == "A" and x.sent > sigterm - 1 for s, x in turned_away), turned_away
    after = [r for r in clients.requests if r and r[0][1].sent > a2_up]
    assert after and all(r[-1][1].whole(reference) for r in after)
    assert any(s == "A2" and x.whole(reference) for s, x in attempts)
