"""`pdserve controller --api-servers N`: N controller processes behind one HTTP port.

Each API server is a whole controller (its own registry, admission, routing and metrics) over the
same workers, so the front end is not capped at one core. They share the HTTP port (SO_REUSEPORT:
the kernel spreads new connections across them); API server i takes worker port --worker-port + i
and names the other N-1 worker ports in its acks, so a worker given any one of them registers
with all of them (worker/discovery.py). Their views of the pool agree because every worker
reports to each of them; requests are not shared: a stream lives and dies with its API server.

This process only supervises: an API server that exits is started again after a backoff
(supervisor.py); SIGTERM or SIGINT reaches each of them (directly when the whole group is
signalled, else passed on from here), and each finishes its streams within --shutdown-timeout;
a second signal stops them at once. They ask the kernel for SIGTERM should this process die.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import time

from pdserve.supervisor import Child, Supervisor, supervise

logger = logging.getLogger("pdserve.controller")

INDEX_FLAG = "--api-server-index"
_PR_SET_PDEATHSIG = 1


def child_command(argv: list[str], index: int) -> list[str]:
    """The command line of API server `index` (argparse keeps the last value given)."""
    return [sys.executable, "-m", "pdserve.cli", "controller", *argv, INDEX_FLAG, str(index)]


def worker_ports(base: int, n: int, index: int) -> tuple[int, list[int]]:
    """API server `index`'s worker port, and its siblings' (what its acks name)."""
    return base + index, [base + j for j in range(n) if j != index]


def _follow_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _spawn(name: str, cmd: list[str]) -> Child:
    # In this process's group: a terminal's Ctrl-C or systemd's stop reaches each at once.
    return Child(name, subprocess.Popen(cmd, preexec_fn=_follow_parent))


def run(argv: list[str], n: int, shutdown_timeout: float) -> int:
    """Start and supervise N API servers until SIGTERM or SIGINT; returns the exit code."""
    sup = Supervisor(_spawn)
    signals: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        signals.append(signum)
        for c in sup.children:
            try:  # a second signal: stop at once
                c.proc.send_signal(signal.SIGTERM if len(signals) == 1 else signal.SIGKILL)
            except ProcessLookupError:
                pass

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    for i in range(n):
        sup.start(f"api-server-{i}", child_command(argv, i))
    logger.info("%d API servers started", n)
    supervise(sup, lambda: bool(signals))
    deadline = time.monotonic() + shutdown_timeout + 15
    for c in sup.children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %g s: killing it", c.name,
                           shutdown_timeout + 15)
            c.proc.kill()
            c.proc.wait()
    return 0
