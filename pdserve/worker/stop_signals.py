"""SIGTERM and SIGINT reach an engine's processes only from the process that runs them.

systemd's default stop (`KillMode=control-group`) sends SIGTERM to every process of the unit: a
worker's engine core and model runners too, which stop at once on it, so a worker that meant to
drain had its streams cut short. The engine core therefore takes those signals only from its
worker (vLLM's own stop of the engine) or from itself (worker/engine_proc.py's follow), and a
model runner only from its engine core; signals from anyone else are logged and dropped.

How: the signals are blocked in every thread of the process and a thread of ours takes them
with their sender (`sigwaitinfo`). A thread that does not block them would take them first, so
the block must come before any thread starts: `block_in_engine_process` runs when pdserve's
command module is imported, which a spawned engine process does first (it is its parent's main
module) before importing vLLM (whose import starts a thread). Threads inherit the mask.
"""

from __future__ import annotations

import _thread
import logging
import os
import signal
import threading
from collections.abc import Callable

# The worker's pid, set in its environment when it builds its engine (worker/engine.py): its
# engine core, and only it, moves to a group of its own and takes stops from it alone.
ENGINE_OWN_GROUP_ENV = "PDSERVE_ENGINE_OWN_GROUP"
ENGINE_CORE_ENV = "PDSERVE_ENGINE_CORE"  # the engine core's pid, for its model runners
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# Under vLLM's logger name: in the engine's processes only vLLM's handler exists.
logger = logging.getLogger(f"vllm.{__name__}")


def engine_parent() -> int | None:
    """The pid whose stops this engine process takes (its worker, or its engine core), or None
    if this process is not one of a worker's engine processes."""
    ppid = str(os.getppid())
    if ppid in (os.environ.get(ENGINE_OWN_GROUP_ENV), os.environ.get(ENGINE_CORE_ENV)):
        return int(ppid)
    return None


def block_in_engine_process() -> None:
    if engine_parent() is not None:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def stops_only_from(senders: set[int], deliver: Callable[[int], None]) -> None:
    """Take SIGTERM and SIGINT from `senders` only: block them (in this thread, and the threads
    it starts later) and hand those that `senders` sent to `deliver`."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def take() -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if info.si_pid in senders:
                deliver(info.si_signo)
            else:
                logger.warning("pdserve: %s from pid %d ignored: this engine process stops when "
                               "its worker stops it (signal the worker)",
                               signal.Signals(info.si_signo).name, info.si_pid)

    threading.Thread(target=take, name="pdserve-stop-signals", daemon=True).start()


def run_handler(sig: int) -> None:
    """Run the signal's handler in this thread. vLLM's engine core handler only records the
    stop and wakes the busy loop from a thread of its own (the main thread may be blocked)."""
    handler = signal.getsignal(sig)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(sig, None)
    else:
        _default_action(sig)


def run_handler_in_main_thread(sig: int) -> None:
    """Have the main thread run the signal's handler (a model runner's raises SystemExit)."""
    if callable(signal.getsignal(sig)):
        _thread.interrupt_main(signal.Signals(sig))
    else:
        _default_action(sig)


def _default_action(sig: int) -> None:
    """What the signal does with no Python handler: nothing if ignored, else its default
    action (the process ends), delivered to this thread."""
    if signal.getsignal(sig) != signal.SIG_IGN:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
