"""`pdserve serve`: a controller and N prefill + M decode workers on this machine, as children.

Each child runs in its own process group (an engine's core process is a grandchild), so stopping
a child stops its whole tree. Once the pool is ready, a worker that exits is restarted after a
backoff (1 s, doubling up to 60 s; back to 1 s after it stayed up a minute), except one that every
controller refused (exit code 3: it would be refused again); the controller exiting ends serve.
Ctrl-C / SIGTERM drains the workers, then stops everything (a worker waiting for its restart is
not started again) and removes the temporary files this command created.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.worker.main import EXIT_REFUSED

logger = logging.getLogger("pdserve.serve")


class ChildExited(RuntimeError):
    """A child serve cannot go on without exited: the controller, or any child at start-up."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def assign_cores(n_engines: int, cores: list[int]) -> list[str | None]:
    """The cores split evenly between the engines (the first ones get any remainder), each
    worker kept to its share; with fewer cores than engines, none: on CPU hosts the workers
    then claim a core each themselves, shared where needed (pdserve.worker.cores)."""
    if n_engines == 0 or n_engines > len(cores):
        return [None] * n_engines
    share, extra = divmod(len(cores), n_engines)
    out, start = [], 0
    for i in range(n_engines):
        mine = cores[start:start + share + (i < extra)]
        start += len(mine)
        out.append(",".join(map(str, mine)))
    return out


def worker_command(role: str, controller: str, model: str, cores: str | None,
                   keys: str | None, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "worker", "--role", role,
           "--controller", controller, "--model", model, "--advertise-host", "127.0.0.1"]
    if cores is not None:
        cmd += ["--cores", cores]
    if keys:
        cmd += ["--keys", keys]
    return cmd + extra


def _get_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base: str, expected: int, children: list[Child], timeout: float,
               stopping: Callable[[], bool] = lambda: False) -> bool:
    """True once `expected` workers are ready; False if `stopping()` turns true first. A child
    exiting now is an error, not restarted: at start-up it is most likely a wrong flag."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stopping():
            return False
        for c in children:
            if c.proc.poll() is not None:
                raise ChildExited(f"{c.name} exited with code {c.proc.returncode} during start-up")
        try:
            workers = _get_json(base + "/pd/workers")
            if sum(w["state"] == "ready" for w in workers) >= expected:
                return True
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the pool was not ready after {timeout:.0f} s")


def serve(args) -> int:
    from pdserve.models import ensure_model
    from pdserve.transport import keygen

    model = args.model or str(ensure_model("tiny"))
    tmp = tempfile.mkdtemp(prefix="pdserve-serve-")
    keys = args.keys
    if keys is None and not args.no_keys:
        keys = os.path.join(tmp, "keys")
        keygen(keys)
    env = dict(os.environ)
    env.setdefault("VLLM_RPC_BASE_PATH", tmp)

    def spawn(name: str, cmd: list[str]) -> Child:
        return Child(name, subprocess.Popen(cmd, env=env, start_new_session=True))

    sup = Supervisor(spawn)
    ctl = [sys.executable, "-m", "pdserve.cli", "controller", "--model", model,
           "--host", args.host, "--port", str(args.port), "--worker-host", "127.0.0.1",
           "--worker-port", str(args.worker_port), *args.controller_arg]
    if keys:
        ctl += ["--keys", keys]
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    base = f"http://{args.host}:{args.port}"
    try:
        sup.start("controller", ctl, restart=False)
        controller_url = f"tcp://127.0.0.1:{args.worker_port}"
        roles = ["prefill"] * args.prefill + ["decode"] * args.decode
        cores = assign_cores(len(roles), sorted(os.sched_getaffinity(0)))
        counts: dict[str, int] = {}
        for role, core in zip(roles, cores):
            counts[role] = counts.get(role, 0) + 1
            sup.start(f"{role}-{counts[role]}", worker_command(role, controller_url, model, core,
                                                               keys, args.worker_arg))
        if not wait_ready(base, len(roles), sup.children, args.start_timeout, lambda: stopping):
            return 0
        print(f"pdserve ready: {base}/v1  ({args.prefill} prefill, {args.decode} decode; "
              f"pool at {base}/pd/workers, dashboard at {base}/pd/dashboard)", flush=True)
        supervise(sup, lambda: stopping)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 1
    finally:
        stop_children(sup.children, drain_timeout=args.drain_timeout)
        shutil.rmtree(tmp, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)


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
    (in its own process group) and `clock` tells the time: both are seams for tests."""

    def __init__(self, spawn: Callable[[str, list[str]], Child],
                 clock: Callable[[], float] = time.monotonic,
                 backoff: Callable[[], Backoff] = Backoff):
        self._spawn, self._clock, self._backoff = spawn, clock, backoff
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
        self._run(s)
        return s.child

    def check(self) -> None:
        """Notice children that exited, and restart those whose backoff is over."""
        now = self._clock()
        for s in list(self._all):
            if s.child is not None and (code := s.child.proc.poll()) is not None:
                self._exited(s, code, now)
            elif s.due is not None and now >= s.due:
                s.restarts += 1
                self._run(s)

    def _run(self, s: _Supervised) -> None:
        s.child, s.started, s.due = self._spawn(s.name, s.cmd), self._clock(), None

    def _exited(self, s: _Supervised, code: int, now: float) -> None:
        s.child.signal_group(signal.SIGKILL)  # whatever it left running in its group
        s.child = None
        if not s.restart:
            raise ChildExited(f"{s.name} exited with code {code}")
        if code == EXIT_REFUSED:
            self._all.remove(s)
            logger.error("%s exited with code %d: every controller refused it (see its log "
                         "above); not restarting it, it would be refused again", s.name, code)
            return
        delay = s.backoff.delay(now - s.started)
        s.due = now + delay
        logger.warning("%s exited with code %d; restarting in %g s (restart %d)", s.name, code,
                       delay, s.restarts + 1)


def stop_children(children: list[Child], drain_timeout: float) -> None:
    """SIGTERM workers (they drain), then the controller; SIGKILL whatever is left."""
    workers = [c for c in children if c.name != "controller"]
    for c in workers:
        c.signal_group(signal.SIGTERM)
    _wait(workers, drain_timeout)
    for c in children:
        if c.proc.poll() is None:
            c.signal_group(signal.SIGTERM)
    _wait(children, 15)
    for c in children:
        c.signal_group(signal.SIGKILL)  # also reaps engine processes left in the group
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
