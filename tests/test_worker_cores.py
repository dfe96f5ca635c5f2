"""The worker's --cores list: parsed as vLLM's VLLM_CPU_OMP_THREADS_BIND reads it, and applied to
the whole worker process (its engine's processes inherit it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.worker.engine import parse_cores


@pytest.mark.parametrize("spec, cores", [("0", {0}), ("3", {3}), ("0-3", {0, 1, 2, 3}),
                                         ("0,2-3", {0, 2, 3}), (" 1 , 4-5", {1, 4, 5})])
def test_parse_cores(spec: str, cores: set[int]) -> None:
    assert parse_cores(spec) == cores


@pytest.mark.parametrize("spec", ["", "a", "3-1", "-1", "0-", "1,,2"])
def test_bad_core_lists_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_cores(spec)


def test_pin_applies_to_the_process_and_its_children() -> None:
    mine = sorted(os.sched_getaffinity(0))
    core = mine[-1]
    code = ("import os, subprocess, sys, threading\n"
            "from pdserve.worker.main import pin\n"
            "started = threading.Event(); stop = threading.Event()\n"
            "def early():\n"
            "    started.set(); stop.wait()\n"
            "t = threading.Thread(target=early); t.start(); started.wait()\n"
            f"pin('{core}')\n"
            "masks = {tuple(sorted(os.sched_getaffinity(int(x))))\n"
            "         for x in os.listdir('/proc/self/task')}\n"
            "stop.set(); t.join()\n"
            f"assert masks == {{({core},)}}, masks  # a thread started before pin() too\n"
            "child = subprocess.run([sys.executable, '-c', 'import os; "
            "print(sorted(os.sched_getaffinity(0)))'], capture_output=True, text=True)\n"
            "print(sorted(os.sched_getaffinity(0)), child.stdout.strip())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{core}]", f"[{core}]"]


def test_pin_to_a_core_this_machine_lacks_exits_with_a_reason() -> None:
    code = "from pdserve.worker.main import pin\npin('4096')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--cores 4096" in out.stderr


@pytest.mark.parametrize("n, cores, want", [
    (2, [0, 1], ["0", "1"]),
    (2, [0, 1, 2, 3, 4], ["0,1,2", "3,4"]),
    (3, [4, 5, 6, 7], ["4,5", "6", "7"]),
    (3, [0, 1], [None, None, None]),  # more engines than cores: the OS shares them
    (0, [0, 1], []),
])
def test_the_launcher_splits_the_cores_between_engines(n: int, cores: list[int],
                                                       want: list[str | None]) -> None:
    from pdserve.launcher import assign_cores

    got = assign_cores(n, cores)
    assert got == want
    pinned = [parse_cores(c) for c in got if c is not None]
    assert all(a.isdisjoint(b) for i, a in enumerate(pinned) for b in pinned[i + 1:])


@pytest.mark.parametrize("spec, reason", [("4096", "none of these is a core this process may use"),
                                          ("1-a", "bad core list")])
def test_front_cores_a_worker_cannot_use_are_refused_before_its_engine_starts(
        spec: str, reason: str) -> None:
    """--front-cores applies once the engine has started; a wrong list is said at once."""
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "worker", "--role", "decode",
                          "--controller", "tcp://127.0.0.1:9", "--model", "/nonexistent",
                          "--front-cores", spec], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"--front-cores {spec}: " in out.stderr and reason in out.stderr, out.stderr
    assert "/nonexistent" not in out.stderr  # said before the model was even looked for
