"""Runs in every vLLM process (a vLLM general plugin, pyproject.toml); acts in a worker's
engine core only.

A terminal's Ctrl-C, systemd's default stop and `kill -- -PGID` signal the worker's whole process
group. vLLM's engine core shuts down at once on SIGINT/SIGTERM, so a group signal used to stop
the engine under a worker that meant to drain (streams cut short). The engine core therefore
moves to a process group of its own (its model-runner processes, started later, join it): only
the worker decides when its engine stops. So that no engine outlives its worker (kill -9 of the
worker), the engine core asks the kernel for SIGTERM when the worker dies (vLLM's handler
then shuts the engine down, model runners and shared memory included). The worker names
itself in an environment variable; a process whose parent is not that worker (a plain vLLM
server, the engine core's own children) is left alone.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

from pdserve.worker.engine import ENGINE_OWN_GROUP_ENV

_PR_SET_PDEATHSIG = 1


def setup() -> None:
    parent = multiprocessing.parent_process()
    if parent is None or os.environ.get(ENGINE_OWN_GROUP_ENV) != str(parent.pid):
        return  # the worker itself, the engine core's own children, or not under a worker
    libc = ctypes.CDLL(None, use_errno=True)
    # SIGTERM, not SIGKILL: vLLM's handler then stops the model runners and frees the shared
    # memory they hold (a SIGKILL left 160-400 MiB in /dev/shm per killed worker).
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent.pid:
        os._exit(1)  # the parent died before the request above: follow it
    os.setpgid(0, 0)
