"""`pdserve serve`'s supervision: workers that exit are restarted with backoff, the controller
exiting ends serve, stopping stops everything. Cheap child commands stand in for the workers."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from procs import gone

from pdserve.launcher import wait_ready
from pdserve.supervisor import (Backoff, Child, ChildExited, Supervisor, stop_children,
                                supervise)
from pdserve.worker.main import DRAIN_SIGNAL


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeProc:
    def __init__(self):
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class FakeChild(Child):
    def __init__(self, name: str):
        super().__init__(name, FakeProc())
        self.signals: list[int] = []

    def signal_group(self, sig: int) -> None:
        self.signals.append(sig)


class FakeSpawner:
    def __init__(self):
        self.started: list[FakeChild] = []

    def __call__(self, name: str, cmd: list[str]) -> FakeChild:
        self.started.append(FakeChild(name))
        return self.started[-1]

    def of(self, name: str) -> list[FakeChild]:
        return [c for c in self.started if c.name == name]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def spawner() -> FakeSpawner:
    return FakeSpawner()


@pytest.fixture
def sup(clock, spawner) -> Supervisor:
    return Supervisor(spawner, clock)


def test_backoff_doubles_up_to_its_most() -> None:
    b = Backoff(first=1, most=60, settle=60)
    assert [b.delay(uptime=0.5) for _ in range(9)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def test_backoff_starts_over_after_a_child_stayed_up() -> None:
    b = Backoff(first=1, most=60, settle=60)
    assert [b.delay(5), b.delay(5), b.delay(5)] == [1, 2, 4]
    assert b.delay(60) == 1  # up a minute: its crash is news, not a loop
    assert b.delay(59) == 2


def test_a_worker_that_exits_is_restarted_after_its_backoff(sup, clock, spawner, caplog) -> None:
    sup.start("controller", ["ctl"], restart=False)
    sup.start("prefill-1", ["w"])
    first = spawner.of("prefill-1")[0]
    clock.now += 30
    first.proc.returncode = 1
    with caplog.at_level(logging.INFO, logger="pdserve.serve"):
        sup.check()
        assert first.signals == [signal.SIGKILL]  # whatever it left in its group goes too
        assert [c.name for c in sup.children] == ["controller"]  # waiting: nothing to stop
        clock.now += 0.9
        sup.check()
        assert len(spawner.of("prefill-1")) == 1
        clock.now += 0.1
        sup.check()
        assert len(spawner.of("prefill-1")) == 2 and sup.restarts("prefill-1") == 1
        spawner.of("prefill-1")[1].proc.returncode = 1  # at once again: twice the wait
        clock.now += 1
        sup.check()
        clock.now += 1.9
        sup.check()
        assert len(spawner.of("prefill-1")) == 2
        clock.now += 0.1
        sup.check()
        assert len(spawner.of("prefill-1")) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "prefill-1 exited with code 1; restarting in 1 s (restart 1)",
        "prefill-1 exited with code 1; restarting in 2 s (restart 2)",
    ]
    assert [c.name for c in sup.children] == ["controller", "prefill-1"]


def test_the_backoff_is_per_worker(sup, clock, spawner) -> None:
    for name in ("prefill-1", "decode-1"):
        sup.start(name, [name])
    for _ in range(3):  # prefill-1 keeps failing: 1 + 2 + 4 s
        spawner.of("prefill-1")[-1].proc.returncode = 1
        sup.check()
        clock.now += 4
        sup.check()
    spawner.of("decode-1")[-1].proc.returncode = -9
    sup.check()
    clock.now += 1
    sup.check()
    assert (len(spawner.of("prefill-1")), len(spawner.of("decode-1"))) == (4, 2)


def test_the_controller_exiting_ends_serve(sup, spawner) -> None:
    sup.start("controller", ["ctl"], restart=False)
    spawner.of("controller")[0].proc.returncode = 1
    with pytest.raises(ChildExited, match="controller exited with code 1"):
        sup.check()
    assert len(spawner.started) == 1


def test_a_worker_every_controller_refused_is_not_restarted(sup, clock, spawner, caplog) -> None:
    sup.start("decode-1", ["w"])
    spawner.of("decode-1")[0].proc.returncode = 3
    with caplog.at_level(logging.INFO, logger="pdserve.serve"):
        sup.check()
    for _ in range(5):
        clock.now += 60
        sup.check()
    assert len(spawner.started) == 1 and sup.children == []
    assert "decode-1 exited with code 3: every controller refused it" in caplog.text
    assert "not restarting it" in caplog.text


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# Like a worker and its engine core: a child in its group; "up" once both run.
WORKER_WITH_ENGINE = python(
    "import subprocess, sys, time\n"
    "engine = subprocess.Popen([sys.executable, '-c', 'print(1, flush=True); "
    "import time; time.sleep(300)'], stdout=subprocess.PIPE)\n"
    "engine.stdout.readline(); print('up', flush=True); time.sleep(300)\n")


@pytest.fixture
def real_spawner():
    """Spawners of real children; whatever a test leaves running is killed after it."""
    children: list[Child] = []

    def make(started: list[tuple[str, float]]):
        def spawn(name: str, cmd: list[str]) -> Child:
            started.append((name, time.monotonic()))
            children.append(Child(name, subprocess.Popen(cmd, start_new_session=True,
                                                         stdout=subprocess.PIPE, text=True)))
            return children[-1]

        return spawn

    yield make
    for c in children:
        c.signal_group(signal.SIGKILL)
        c.proc.wait(30)
        c.proc.stdout.close()


def test_the_loop_restarts_a_crashing_worker_with_growing_waits(real_spawner, caplog) -> None:
    started: list[tuple[str, float]] = []
    sup = Supervisor(real_spawner(started), backoff=lambda: Backoff(first=0.2, most=0.4))
    sup.start("prefill-1", python("import sys; sys.exit(1)"))
    deadline = time.monotonic() + 60
    with caplog.at_level(logging.INFO, logger="pdserve.serve"):
        supervise(sup, lambda: sup.restarts("prefill-1") >= 3 or time.monotonic() > deadline,
                  interval=0.02)
    stop_children(sup.children, drain_timeout=5)
    times = [t for _, t in started]
    assert len(times) == 4
    waits = [b - a for a, b in zip(times, times[1:])]
    assert waits[0] >= 0.2 and waits[1] >= 0.4 and waits[2] >= 0.4
    assert [r.getMessage() for r in caplog.records] == [
        "prefill-1 exited with code 1; restarting in 0.2 s (restart 1)",
        "prefill-1 exited with code 1; restarting in 0.4 s (restart 2)",
        "prefill-1 exited with code 1; restarting in 0.4 s (restart 3)",
    ]


def test_stopping_stops_every_worker_and_restarts_none(real_spawner) -> None:
    started: list[tuple[str, float]] = []
    sup = Supervisor(real_spawner(started), backoff=lambda: Backoff(first=30))
    # A worker with an engine-like grandchild in its group, and one that crashed and waits.
    up = sup.start("decode-1", WORKER_WITH_ENGINE)
    assert up.proc.stdout.readline() == "up\n"
    sup.start("prefill-1", python("import sys; sys.exit(1)"))
    t0 = time.monotonic()
    supervise(sup, lambda: time.monotonic() - t0 > 1.5, interval=0.05)
    assert sup.restarts("prefill-1") == 0 and [c.name for c in sup.children] == ["decode-1"]
    stop_children(sup.children, drain_timeout=5)
    assert up.proc.returncode is not None
    assert gone(up.proc.pid)  # the grandchild too
    assert [name for name, _ in started] == ["decode-1", "prefill-1"]


class _LoggedProc(FakeProc):
    """Its signals and its exit (when waited on) go into a log shared with other children."""

    def __init__(self, name: str, log: list[tuple[str, str]]):
        super().__init__()
        self.name, self.log = name, log

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = 0
            self.log.append((self.name, "exited"))
        return 0

    def send_signal(self, sig: int) -> None:
        self.log.append((self.name, signal.Signals(sig).name))


class _LoggedChild(Child):
    def signal_group(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


def test_stopping_stops_the_controller_before_the_workers_drain() -> None:
    """The controller stops first (new requests refused, its streams finishing on workers that
    still take their legs); only once it has exited are the workers told to drain."""
    log: list[tuple[str, str]] = []
    children: list[Child] = [
        _LoggedChild(name, _LoggedProc(name, log), worker=name != "controller")
        for name in ("controller", "prefill-1", "decode-1")]
    stop_children(children, drain_timeout=5)
    drain = signal.Signals(DRAIN_SIGNAL).name
    assert log == [("controller", "SIGTERM"), ("controller", "exited"),
                   ("prefill-1", drain), ("decode-1", drain),
                   ("prefill-1", "exited"), ("decode-1", "exited")]


def test_the_loop_ends_when_the_controller_exits(real_spawner) -> None:
    sup = Supervisor(real_spawner([]))
    sup.start("controller", python("import sys; sys.exit(2)"), restart=False)
    deadline = time.monotonic() + 30
    with pytest.raises(ChildExited, match="controller exited with code 2"):
        supervise(sup, lambda: time.monotonic() > deadline, interval=0.02)


def test_what_a_killed_worker_left_is_stopped_before_its_restart(real_spawner) -> None:
    sup = Supervisor(real_spawner([]), backoff=lambda: Backoff(first=30))
    w = sup.start("prefill-1", WORKER_WITH_ENGINE)
    assert w.proc.stdout.readline() == "up\n"
    os.kill(w.proc.pid, signal.SIGKILL)  # like kill -9 of a worker: its engine core lingers
    w.proc.wait(30)
    assert not gone(w.proc.pid, timeout=0.5)
    sup.check()
    assert gone(w.proc.pid)


def test_waiting_for_the_pool_ends_when_serve_is_stopped() -> None:
    t0 = time.monotonic()
    assert wait_ready("http://127.0.0.1:9", 1, [], timeout=30, stopping=lambda: True) is False
    assert time.monotonic() - t0 < 5


# --- several API servers ----------------------------------------------------------------------

def serve_args(*argv: str):
    from pdserve.cli import _serve_parser

    return _serve_parser().parse_args(list(argv))


def test_the_controller_is_given_the_api_servers_and_the_workers_the_first_port() -> None:
    from pdserve.launcher import controller_command

    args = serve_args("--api-servers", "3", "--port", "9000", "--worker-port", "9001",
                      "--controller-arg=--dead-after=5")
    cmd = controller_command(args, "/m", "tiny", "/k")
    assert cmd[cmd.index("--api-servers") + 1] == "3"
    assert cmd[cmd.index("--worker-port") + 1] == "9001"
    assert cmd[cmd.index("--port") + 1] == "9000"
    assert cmd[-1] == "--dead-after=5"  # the user's own flags last: they win
    assert "--api-servers" not in controller_command(serve_args(), "/m", None, None)
    with pytest.raises(SystemExit):
        serve_args("--api-servers", "0")


def test_the_controller_keeps_to_the_prefill_workers_cores() -> None:
    from pdserve.launcher import controller_command, controller_cores

    assert controller_cores(["prefill", "decode"], ["0", "1"]) == "0"
    assert controller_cores(["prefill", "prefill", "decode"], ["0", "1", "2,3"]) == "0,1"
    assert controller_cores(["prefill", "decode", "decode"], [None, None, None]) is None
    assert controller_cores(["decode", "decode"], ["0", "1"]) is None
    for told in (["--cores=0,1"], ["--api-key", "x", "--cores", "1"]):  # the user's choice
        assert controller_cores(["prefill", "decode"], ["0", "1"], told) is None
    cmd = controller_command(serve_args("--controller-arg=--cores=1"), "/m", None, None, "0")
    assert cmd[cmd.index("--cores") + 1] == "0"
    assert cmd[-1] == "--cores=1"  # the user's own, later: it wins
    assert "--cores" not in controller_command(serve_args(), "/m", None, None)


def test_every_api_servers_worker_port_is_checked_before_start() -> None:
    import socket

    from pdserve.launcher import preflight_problem
    from pdserve.net import free_port

    problem = preflight_problem(serve_args("--api-servers", "3", "--port", "9002",
                                           "--worker-port", "9001"))
    assert problem is not None and "one of the worker ports of the 3 API servers (9001-9003)" \
        in problem
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        second = taken.getsockname()[1]
        problem = preflight_problem(serve_args("--api-servers", "2", "--port", str(free_port()),
                                               "--worker-port", str(second - 1)))
    assert problem is not None and f"port {second} on 127.0.0.1 is in use" in problem


class PoolViews:
    """An HTTP /pd/workers answered in turn by the controllers named, as API servers sharing a
    port answer new connections."""

    def __init__(self, views: list[tuple[str, int]]):
        import http.server
        import json
        import threading

        answers = iter(views)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                controller, ready = next(answers, views[-1])
                body = json.dumps([{"state": "ready"}] * ready).encode()
                self.send_response(200)
                self.send_header("x-pdserve-controller", controller)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.seen = 0

    def progress(self, workers) -> None:
        self.seen += 1


def test_serve_is_ready_once_every_api_server_has_seen_every_worker() -> None:
    # The first controller has both workers at once; the second sees one, then both.
    views = PoolViews([("a", 2), ("b", 1), ("a", 2), ("b", 2), ("a", 2)])
    try:
        assert wait_ready(views.base, 2, [], timeout=30, progress=views.progress, api_servers=2)
        assert views.seen == 4
        one = PoolViews([("a", 2)])
        assert wait_ready(one.base, 2, [], timeout=30, progress=one.progress)
        assert one.seen == 1
        one.server.shutdown()
    finally:
        views.server.shutdown()
