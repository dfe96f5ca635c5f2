"""Processes started by tests: each in its own session, stopped as a whole group, always."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.bench.soak import shm_left
from pdserve.procfs import shm_used, tree
from pdserve.net import free_port, free_ports  # noqa: F401  (tests take them from here)

SHM = Path("/dev/shm")


def shm_of(pid: int) -> set[str]:
    """The /dev/shm files `pid` and its descendants use now (note them before a SIGKILL)."""
    return shm_used(tree(pid))


def remove_shm_left(ours: set[str]) -> list[str]:
    """Remove those of `ours` that no process uses any more. A group killed with SIGKILL takes
    its multiprocessing resource tracker with it, so the named semaphores it would have unlinked
    (`sem.mp-*`, an engine core's executor lock) stay in /dev/shm; returns their names."""
    left = list(shm_left(ours, 0.0, SHM))
    for name in left:
        (SHM / name).unlink(missing_ok=True)
    return left


class Proc:
    """A child process group with its output in a log file."""

    def __init__(self, name: str, cmd: list[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the group, wait, then SIGKILL what is left (a worker's engine core, in a group of
        its own, is stopped by its worker or, if the worker is killed, by its own watcher)."""
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def metric(base: str, name: str) -> float:
    """The sum of /metrics' unlabelled samples called `name` (a counter's `_total`)."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M))


def loopback_bytes() -> int:
    """Bytes this machine's processes have sent each other over loopback so far (all of them)."""
    return int(Path("/sys/class/net/lo/statistics/rx_bytes").read_text())


def wait_for(predicate, timeout: float, what: str, procs: list[Proc] = (),
             every: float = 0.3) -> None:
    """Until `predicate()` holds, looking every `every` s; raises if one of `procs` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited ({p.proc.returncode}) while waiting for "
                                   f"{what}:\n{p.log()[-3000:]}")
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(every)
    tails = "".join(f"\n--- {p.name} (last lines) ---\n{p.log()[-3000:]}" for p in procs)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{tails}")


def ready_workers(base: str, role: str | None = None) -> list[dict]:
    return [w for w in get_json(base + "/pd/workers")
            if w["state"] == "ready" and (role is None or w["role"] == role)]


def children(parent: int) -> dict[int, str]:
    """The live child processes of `parent`: their command lines."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == parent:
                cmdline = (entry / "cmdline").read_bytes()
                out[int(entry.name)] = cmdline.replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
    return out


def engine_core_pid(worker_pid: int) -> int:
    """The engine-core child of a worker process (it runs in a process group of its own)."""
    for pid in children(worker_pid):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text()
        except OSError:
            continue
        if comm.startswith("VLLM::Engine"):  # comm is cut at 15
            return pid
    raise AssertionError(f"no engine core under worker {worker_pid}")


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of process `pid`."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def exited(pid: int) -> bool:
    """Whether process `pid` is gone (or a zombie: exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def survivors(pids: list[int], timeout: float = 10.0) -> dict[int, str]:
    """Those of `pids` still running after up to `timeout`, with their command lines (a child
    that stops when it sees its parent gone, as multiprocessing's resource tracker does, takes a
    moment after the parent's exit)."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if not exited(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    out = {}
    for pid in left:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return out


def gone(pgid: int, timeout: float = 10.0) -> bool:
    """Whether nothing of process group `pgid` is left (init reaps orphans: give it time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
