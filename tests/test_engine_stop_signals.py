"""An engine's processes take SIGTERM/SIGINT only from the process that runs them
(pdserve/worker/stop_signals.py): systemd's default stop signals every process of a unit, and an
engine stopped that way under a draining worker cut its streams short."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from pdserve.worker.stop_signals import ENGINE_CORE_ENV, ENGINE_OWN_GROUP_ENV

# A spawned engine process imports pdserve's command module first (its parent's main module),
# then vLLM, whose import starts a thread.
PROLOGUE = """
import pdserve.cli
import vllm.v1.engine.core
"""

# A model runner: vLLM's handler raises SystemExit in the main thread, which is busy.
RUNNER = PROLOGUE + textwrap.dedent("""
    import os, signal, sys, time
    from pdserve.worker.stop_signals import run_handler_in_main_thread, stops_only_from
    def handler(signum, frame):
        raise SystemExit(7)
    signal.signal(signal.SIGTERM, handler)
    stops_only_from({os.getppid()}, run_handler_in_main_thread)
    print("ready", flush=True)
    while True:
        time.sleep(0.01)
""")

# An engine core: vLLM's handler records the stop and another thread wakes the main thread,
# which is blocked (an idle busy loop waits on its input queue).
CORE = PROLOGUE + textwrap.dedent("""
    import os, signal, sys, threading
    from pdserve.worker.stop_signals import run_handler, stops_only_from
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    stops_only_from({os.getppid(), os.getpid()}, run_handler)
    print("ready", flush=True)
    sys.stdin.readline()  # the test says when
    os.kill(os.getpid(), signal.SIGTERM)  # as the thread that follows the worker does
    stop.wait()
    sys.exit(5)
""")

STOPS_MASK = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))


def start(code: str, env_name: str) -> subprocess.Popen:
    env = {**os.environ, env_name: str(os.getpid())}  # this test runs it
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert p.stdout is not None
    for line in p.stdout:
        if line == "ready\n":
            return p
    raise AssertionError(f"the child exited: {p.wait()}")


def open_threads(pid: int) -> tuple[int, int]:
    """How many threads the process has, and how many of them do not block the stop signals."""
    tasks = list(Path(f"/proc/{pid}/task").iterdir())
    masks = [int(next(line.split()[1] for line in (t / "status").read_text().splitlines()
                      if line.startswith("SigBlk:")), 16) for t in tasks]
    return len(tasks), sum(1 for m in masks if m & STOPS_MASK != STOPS_MASK)


def blocked_but_in_the_taker(pid: int) -> bool:
    """Whether every thread blocks the stop signals but one: the thread waiting for them (the
    kernel unblocks them in a thread while it waits in sigwaitinfo). The taker may print "ready"
    before it reaches sigwaitinfo, so this waits for that (and fails at once on a second open
    thread, which would take a stop first)."""
    for _ in range(500):
        threads, open_ = open_threads(pid)
        if open_ > 1:
            return False
        if threads >= 3 and open_ == 1:  # vLLM's thread, the main one and the taker
            return True
        time.sleep(0.01)
    return False


def from_another_process(sig: int, pid: int) -> None:
    subprocess.run(["kill", f"-{signal.Signals(sig).name[3:]}", str(pid)], check=True)


def test_a_model_runner_ignores_a_stop_from_others_and_takes_its_parents() -> None:
    p = start(RUNNER, ENGINE_CORE_ENV)
    try:
        assert blocked_but_in_the_taker(p.pid)
        for sig in (signal.SIGTERM, signal.SIGINT):
            from_another_process(sig, p.pid)
        time.sleep(1.0)
        assert p.poll() is None, p.communicate()
        p.send_signal(signal.SIGTERM)  # from its parent
        out, _ = p.communicate(timeout=10)
        assert p.returncode == 7, out  # its own handler ran, in its main thread
        assert "SIGTERM from pid" in out and "SIGINT from pid" in out, out
    finally:
        p.kill()
        p.communicate()


def test_an_engine_core_ignores_a_stop_from_others_and_takes_its_own() -> None:
    p = start(CORE, ENGINE_OWN_GROUP_ENV)
    try:
        assert blocked_but_in_the_taker(p.pid)
        from_another_process(signal.SIGTERM, p.pid)
        time.sleep(1.0)
        assert p.poll() is None, p.communicate()
        out, _ = p.communicate("go\n", timeout=10)
        assert p.returncode == 5, out  # the handler ran and woke the blocked main thread
        assert out.count("ignored") == 1, out
    finally:
        p.kill()
        p.communicate()


def test_other_processes_keep_their_signals() -> None:
    p = subprocess.run([sys.executable, "-c", PROLOGUE + "import os, signal, time\n"
                        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)"], timeout=60)
    assert p.returncode == -signal.SIGTERM
