"""Runs in every vLLM process (a vLLM general plugin, pyproject.toml); acts in a worker's
engine core and its model runners only.

A terminal's Ctrl-C and `kill -- -PGID` signal the worker's whole process group. vLLM's engine
core shuts down at once on SIGINT/SIGTERM, so a group signal used to stop the engine under a
worker that meant to drain (streams cut short). The engine core therefore
moves to a process group of its own (its model-runner processes, started later, join it): only
the worker decides when its engine stops. So that no engine outlives its worker (kill -9 of the
worker), a thread of the engine core waits for the worker to exit and then sends the engine
core one SIGTERM (vLLM's handler then shuts the engine down, model runners and shared memory
included). Exactly one: the kernel's parent-death signal, used before, is sent again each time
the dying worker's threads hand the child on to one another, and vLLM's handler is not
re-entrant (a second SIGTERM arriving inside it deadlocked an orphaned engine core for good).
An engine core still there `grace` seconds later (one stuck in its start, where vLLM's handler
only marks it for shutdown) is killed with its process group, after unlinking the shared memory
it maps (vLLM's queues to and from its model runners), which nothing would unlink then.

A process group is not all: systemd's default stop signals every process of the unit, so the
engine core and its model runners take SIGTERM and SIGINT only from the process that runs them
(worker/stop_signals.py).

The worker names itself in an environment variable, and the engine core names itself to its
model runners in another; any other process (a plain vLLM server) is left alone.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from pathlib import Path

from vllm.logger import init_logger

from pdserve.procfs import on_parent_exit
from pdserve.worker.stop_signals import (ENGINE_CORE_ENV, ENGINE_OWN_GROUP_ENV,
                                         run_handler, run_handler_in_main_thread,
                                         stops_only_from)

# Under vLLM's logger: in the engine core only vLLM's handler exists (kv/cpu_nixl.py).
logger = init_logger(f"vllm.{__name__}")


def setup() -> None:
    parent = multiprocessing.parent_process()
    pid = parent.pid if parent is not None else None
    if pid is None:
        return  # not under a worker
    if os.environ.get(ENGINE_OWN_GROUP_ENV) == str(pid):  # a worker's engine core
        stops_only_from({pid, os.getpid()}, run_handler)
        follow(pid)
        os.setpgid(0, 0)
        os.environ[ENGINE_CORE_ENV] = str(os.getpid())  # its model runners start later
    elif os.environ.get(ENGINE_CORE_ENV) == str(pid):  # a model runner of that engine core
        stops_only_from({pid}, run_handler_in_main_thread)


# How long an engine core that lost its worker has to shut down after its SIGTERM (vLLM's own
# shutdown of an idle engine takes a few seconds) before it is killed.
GRACE_S = 20.0
SHM_PREFIX = "/dev/shm/psm_"  # multiprocessing.shared_memory's names, vLLM's shm queues among them


def follow(pid: int, grace: float = GRACE_S) -> None:
    """Send this process one SIGTERM when process `pid`, its parent, exits, and SIGKILL (its
    process group, if it leads one) if it is still there `grace` seconds later."""
    def stop() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        me = os.getpid()
        logger.warning("engine core %d: its worker %d is gone and it did not stop within %g s "
                       "of SIGTERM: killing it", me, pid, grace)
        kill(me)

    if not on_parent_exit(pid, stop, "pdserve-follow-worker"):
        os._exit(1)  # the worker died already: follow it


def kill(pid: int) -> None:
    """SIGKILL engine core `pid` and, once it leads its own group, its model runners with it,
    unlinking the shared memory it maps first."""
    _unlink_shared_memory(pid)
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)


def _unlink_shared_memory(pid: int) -> None:
    """Unlink the POSIX shared memory process `pid` maps (Python's `psm_*` segments): a SIGKILL
    would leave them in /dev/shm, since the resource tracker that unlinks them dies too. The
    mappings stay valid until the processes using them exit."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return
    paths = {parts[5] for parts in (line.split(maxsplit=5) for line in maps.splitlines())
             if len(parts) == 6 and parts[5].startswith(SHM_PREFIX)}
    for path in paths:
        with contextlib.suppress(OSError):  # gone already (" (deleted)"), or not ours to unlink
            os.unlink(path)
