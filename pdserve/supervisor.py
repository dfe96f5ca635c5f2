"""Children of `pdserve serve` (and of the benchmarks' deployments): each in its own process
group, restarted with a backoff when it exits, stopped as a whole.

A worker that exits is restarted after a backoff (1 s, doubling up to 60 s; back to 1 s after it
stayed up a minute), except one that every controller refused (exit code 3: it would be refused
again); a child started with restart=False (the controller) exiting raises ChildExited. What a
child's processes leave in /dev/shm when they are killed is removed (pdserve/leftovers.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.leftovers import Leftovers
from pdserve.worker.main import DRAIN_SIGNAL, EXIT_REFUSED

logger = logging.getLogger("pdserve.serve")


class ChildExited(RuntimeError):
    """A child serve cannot go on without exited: the controller, or any child at start-up."""

    def __init__(self, message: str, child: Child | None = None):
        super().__init__(message)
        self.child = child


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path | None = None  # its output, unless it goes to serve's own
    worker: bool = True  # a pdserve worker: DRAIN_SIGNAL drains it; else a front, stopped first

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def signal(self, sig: int) -> None:
        """This process alone."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


def supervise(sup: Supervisor, stopping: Callable[[], bool], interval: float = 0.5) -> None:
    """Restart workers that exit until `stopping()`; raises ChildExited if the controller exits."""
    while not stopping():
        sup.check()
        time.sleep(interval)


@dataclass
class Backoff:
    """Seconds to wait before each restart of one child: `first`, doubling up to `most`; a
    child that stayed up `settle` seconds before exiting starts again from `first`."""

    first: float = 1.0
    most: float = 60.0
    settle: float = 60.0
    _next: float = field(default=0.0, init=False, repr=False)

    def delay(self, uptime: float) -> float:
        if uptime >= self.settle or not self._next:
            self._next = self.first
        delay, self._next = self._next, min(self._next * 2, self.most)
        return delay


@dataclass
class _Supervised:
    name: str
    cmd: list[str]
    restart: bool
    backoff: Backoff
    child: Child | None = None
    started: float = 0.0
    due: float | None = None  # when its restart is due, while it waits for one
    restarts: int = 0


class Supervisor:
    """Starts children and restarts those that exit, after a backoff. `spawn` starts one child
    (in its own process group) and `clock` tells the time: both are seams for tests, as is
    `leftovers` (None: /dev/shm is not looked at)."""

    def __init__(self, spawn: Callable[[str, list[str]], Child],
                 clock: Callable[[], float] = time.monotonic,
                 backoff: Callable[[], Backoff] = Backoff,
                 leftovers: Leftovers | None = None):
        self._spawn, self._clock, self._backoff = spawn, clock, backoff
        self.leftovers = leftovers
        self._all: list[_Supervised] = []

    @property
    def children(self) -> list[Child]:
        """The children running now (not those waiting for their restart)."""
        return [s.child for s in self._all if s.child is not None]

    def restarts(self, name: str) -> int:
        return next(s.restarts for s in self._all if s.name == name)

    def start(self, name: str, cmd: list[str], restart: bool = True) -> Child:
        s = _Supervised(name, cmd, restart, self._backoff())
        self._all.append(s)
        return self._run(s)

    def check(self) -> None:
        """Notice children that exited, and restart those whose backoff is over."""
        now = self._clock()
        for s in list(self._all):
            if (child := s.child) is not None and (code := child.proc.poll()) is not None:
                self._exited(s, child, code, now)
            elif s.due is not None and now >= s.due:
                s.restarts += 1
                self._run(s)
        self.look()

    def look(self) -> None:
        """Note what the running children's processes use in /dev/shm where a look is due, and
        remove what ended ones left (without `leftovers`: nothing). `check` does it; serve's
        start-up, which restarts nobody, calls it alone."""
        if (left := self.leftovers) is None:
            return
        now = self._clock()
        left.glance(now)
        for c in self.children:
            left.note(c.name, c.proc.pid, now)
        left.sweep(now)

    def stop(self, drain_timeout: float, timeout: float = 5.0) -> None:
        """Stop every child (stop_children), then SIGKILL what is left of their processes (an
        engine core whose worker was killed stops by itself, but only ~20 s later) and remove
        what they left in /dev/shm, waiting up to `timeout` s for the kernel to reap them. The
        children's processes are looked at first: a worker restarted moments ago may have
        started its engine since the last look."""
        left, children = self.leftovers, self.children
        if left is None:
            stop_children(children, drain_timeout)
            return
        for c in children:
            left.note(c.name, c.proc.pid, self._clock(), force=True)
        stop_children(children, drain_timeout)
        for c in children:
            left.ended(c.proc.pid, self._clock())
        left.stop_left()
        deadline = time.monotonic() + timeout
        while True:
            left.sweep(self._clock())
            if not left.pending() or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _run(self, s: _Supervised) -> Child:
        child = self._spawn(s.name, s.cmd)
        s.child, s.started, s.due = child, self._clock(), None
        return child

    def _exited(self, s: _Supervised, child: Child, code: int, now: float) -> None:
        child.signal_group(signal.SIGKILL)  # whatever it left running in its group
        s.child = None
        if self.leftovers is not None:
            self.leftovers.ended(child.proc.pid, now)
        if not s.restart:
            raise ChildExited(f"{s.name} exited with code {code}", child)
        if code == EXIT_REFUSED:
            self._all.remove(s)
            logger.error("%s exited with code %d: every controller refused it (see its log); "
                         "not restarting it, it would be refused again", s.name, code)
            return
        delay = s.backoff.delay(now - s.started)
        s.due = now + delay
        logger.warning("%s exited with code %d; restarting in %g s (restart %d)", s.name, code,
                       delay, s.restarts + 1)


def stop_children(children: list[Child], drain_timeout: float) -> None:
    """Stop the front first: SIGTERM every child that is not a worker (the controller), which
    refuses new requests (503, /health failing) and lets its streams finish while the workers
    still take their legs; a draining worker refuses new legs, a decode leg included, so
    draining the workers first would strand a request between its prefill and its decode.
    Then drain the workers, SIGTERM whatever is left (workers still there stop at once), and
    SIGKILL what is left after that."""
    front = [c for c in children if not c.worker]
    workers = [c for c in children if c.worker]
    for c in front:
        c.signal_group(signal.SIGTERM)
    _wait(front, drain_timeout)
    for c in workers:  # drain-only: under systemd's stop it has had SIGTERM already, and a
        c.signal(DRAIN_SIGNAL)  # second SIGTERM would stop it at once
    _wait(workers, drain_timeout)
    for c in children:
        if c.proc.poll() is None:
            c.signal_group(signal.SIGTERM)
    _wait(children, 15)
    for c in children:
        c.signal_group(signal.SIGKILL)  # a worker's engine core then gets SIGTERM (engine_proc.py)
        try:
            c.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _wait(children: list[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
