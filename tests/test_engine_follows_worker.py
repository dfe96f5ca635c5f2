"""An engine core follows its worker when the worker is killed (pdserve/worker/engine_proc.py):
one SIGTERM, however many threads the worker had. vLLM's handler is not re-entrant; the
kernel's parent-death signal, used before, came twice in 4 of 6 runs of this test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from procs import exited

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from pdserve.worker.engine_proc import follow
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append(time.monotonic()))
    follow(os.getppid())
    print("ready", flush=True)
    while not got:
        time.sleep(0.01)
    time.sleep(1.0)  # any further signal would land meanwhile
    open(sys.argv[1], "w").write(str(len(got)))
""")

PARENT = textwrap.dedent("""
    import os, signal, subprocess, sys, threading, time
    for _ in range(32):  # a worker has threads (ZMQ, asyncio's executor, ...)
        threading.Thread(target=lambda: [time.sleep(0.001) for _ in iter(int, 1)],
                         daemon=True).start()
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                             stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_workers_engine_gets_exactly_one_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "signals"
    parent = subprocess.run([sys.executable, "-c", PARENT, CHILD, str(out)], timeout=30)
    assert parent.returncode == -9
    deadline = time.monotonic() + 20
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text() == "1"


STUCK = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from multiprocessing import shared_memory
    from pdserve.worker.engine_proc import follow
    # An engine core stuck in its start: vLLM's handler only marks it for shutdown.
    signal.signal(signal.SIGTERM, lambda *a: None)
    follow(os.getppid(), grace=0.5)
    os.setpgid(0, 0)
    runner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    queue = shared_memory.SharedMemory(create=True, size=1 << 20)  # as vLLM's queues are made
    print(os.getpid(), runner.pid, queue.name, flush=True)
    time.sleep(300)
""")

KILLED_WITH = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                             text=True)
    print(child.stdout.readline().strip(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_an_engine_that_ignores_the_sigterm_is_killed_with_its_group_after_the_grace() -> None:
    parent = subprocess.run([sys.executable, "-c", KILLED_WITH, STUCK], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, timeout=60)
    assert parent.returncode == -9
    core, runner, queue = parent.stdout.split()
    segment = Path("/dev/shm") / queue
    deadline = time.monotonic() + 20
    while not (exited(int(core)) and exited(int(runner))) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        # The stand-in model runner went with its group, and the shared memory is not left over.
        assert exited(int(core)) and exited(int(runner))
        assert not segment.exists()
    finally:
        for pid in (int(core), int(runner)):
            if not exited(pid):
                os.kill(pid, 9)
        segment.unlink(missing_ok=True)
