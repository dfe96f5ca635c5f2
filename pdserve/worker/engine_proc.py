"""Runs in each process of a worker's engine, as a vLLM general plugin (pyproject.toml).

A terminal's Ctrl-C, systemd's default stop and `kill -- -PGID` signal the worker's whole process
group. vLLM's engine core shuts down at once on SIGINT/SIGTERM, so a group signal used to stop
the engine under a worker that meant to drain (streams cut short). Each engine process therefore
moves to a process group of its own: only the worker decides when its engine stops. So that no
engine outlives its worker (kill -9 of the worker), each also asks the kernel for SIGKILL when
its parent dies. Only processes started by a pdserve worker do this (the worker sets the
environment variable below); a plain vLLM server in the same environment is left alone.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

from pdserve.worker.engine import ENGINE_OWN_GROUP_ENV

_PR_SET_PDEATHSIG = 1


def setup() -> None:
    if os.environ.get(ENGINE_OWN_GROUP_ENV) != "1" or multiprocessing.parent_process() is None:
        return  # the worker itself, or not under a pdserve worker
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != multiprocessing.parent_process().pid:
        os._exit(1)  # the parent died before the request above: follow it
    os.setpgid(0, 0)
