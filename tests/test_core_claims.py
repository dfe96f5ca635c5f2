"""Host-local core claims (pdserve.worker.cores): CPU workers started without --cores take a core
no other worker holds, share the least-claimed one when none is free, and never keep a claim
past their own life. The cores here are only names of lock files: no process is pinned."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from pdserve.worker import cores

HOLDER = """
import sys
from pdserve.worker import cores
c = cores.claim(cpus={cpus!r})
print(c.spec, c.others, flush=True)
{then}
sys.stdin.read()  # hold the claim until the test closes stdin
"""


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    folder = str(tmp_path / "locks")
    monkeypatch.setenv(cores.LOCK_DIR_ENV, folder)
    yield folder
    cores._close_all()  # the claims this test made in-process


def holder(cpus: set[int], then: str = "") -> subprocess.Popen:
    """A process that claims one of `cpus` and holds it; it prints "CORE OTHERS" once claimed."""
    return subprocess.Popen([sys.executable, "-c", HOLDER.format(cpus=cpus, then=then)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def claimed(p: subprocess.Popen) -> tuple[int, int]:
    line = p.stdout.readline()
    assert line, f"the holder exited with {p.wait(30)}"
    core, others = line.split()
    return int(core), int(others)


def stop(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(30)
    p.stdin.close()
    p.stdout.close()


def wait_free(core: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while cores.holders(core) and time.monotonic() < deadline:
        time.sleep(0.05)
    return cores.holders(core)


def test_workers_starting_together_take_different_free_cores() -> None:
    procs = [holder({0, 1, 2}) for _ in range(3)]  # racing: started before any has claimed
    try:
        got = [claimed(p) for p in procs]
    finally:
        for p in procs:
            stop(p)
    assert sorted(core for core, _ in got) == [0, 1, 2]
    assert all(others == 0 for _, others in got)


def test_with_every_core_claimed_the_next_shares_the_least_claimed_one() -> None:
    held = [cores.claim(cpus={0, 1})]
    held.append(cores.claim(cpus={0, 1}))
    assert [(c.cores, c.others) for c in held] == [([0], 0), ([1], 0)]
    held.append(cores.claim(cpus={0, 1}))
    assert (held[-1].cores, held[-1].others) == ([0], 1)  # a tie: the lowest id
    held.append(cores.claim(cpus={0, 1}))
    assert (held[-1].cores, held[-1].others) == ([1], 1)
    held[1].release()  # core 1 now has one holder, core 0 two
    nxt = cores.claim(cpus={0, 1})
    assert (nxt.cores, nxt.others) == ([1], 1)
    assert (cores.holders(0), cores.holders(1)) == (2, 2)


def test_a_claim_of_a_process_killed_with_sigkill_is_free_again() -> None:
    p = holder({5})
    try:
        assert claimed(p) == (5, 0)
        assert cores.holders(5) == 1
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        c = cores.claim(cpus={5})
        assert (c.cores, c.others) == ([5], 0)  # the stale lock file is simply free
    finally:
        stop(p)


@pytest.mark.parametrize("child", [
    "os.fork() or time.sleep(300)",  # vLLM's fork start method (GPU hosts)
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])",  # exec: spawn
])
def test_an_orphaned_child_does_not_keep_a_dead_workers_claim(child: str) -> None:
    """vLLM's engine core outlives a worker killed with SIGKILL; the claim must not."""
    p = holder({7}, then=f"import os, subprocess, sys, time\n{child}")
    try:
        assert claimed(p) == (7, 0)
        time.sleep(0.5)  # let the child start
        os.kill(p.pid, signal.SIGKILL)  # the worker only: its child lingers in the group
        p.wait(30)
        os.killpg(p.pid, 0)  # raises if nothing of the group is left
        assert wait_free(7) == 0
    finally:
        stop(p)


def test_given_cores_are_recorded_so_claimers_keep_off_them() -> None:
    given = cores.hold({0, 2})
    assert given.cores == [0, 2] and given.others == 0
    c = cores.claim(cpus={0, 1, 2})
    assert c.cores == [1]
    again = cores.hold({2})  # a second worker given the same core is told it shares it
    assert again.others == 1


def test_claims_of_several_cores_and_their_spec() -> None:
    cores.claim(cpus={3})
    c = cores.claim(count=2, cpus={1, 3, 4})
    assert c.spec == "1,4" and c.others == 0
    big = cores.claim(count=5, cpus={1, 3})
    assert big.cores == [1, 3] and big.others == 1  # count is capped at the cores there are


def test_release_frees_the_cores() -> None:
    c = cores.claim(count=2, cpus={0, 1})
    c.release()
    c.release()  # twice is harmless
    assert (cores.holders(0), cores.holders(1)) == (0, 0)


def test_no_cores_to_claim_is_an_error() -> None:
    with pytest.raises(ValueError):
        cores.claim(cpus=set())
    with pytest.raises(ValueError):
        cores.claim(count=0, cpus={0})


def test_the_lock_folder_is_made_writable_for_every_user(lock_dir: str) -> None:
    cores.claim(cpus={0})
    assert stat.S_IMODE(os.stat(lock_dir).st_mode) == 0o1777
    assert sorted(os.listdir(lock_dir)) == ["claiming", "core0.0"]


def test_the_default_lock_folder_is_host_wide_not_under_tmpdir(monkeypatch) -> None:
    monkeypatch.delenv(cores.LOCK_DIR_ENV)
    assert cores.lock_dir() == cores.DEFAULT_LOCK_DIR
    assert not cores.lock_dir().startswith(os.environ.get("TMPDIR") or "/tmp")
    assert cores.holders(10**6) == 0  # counting never creates files


def test_a_cpu_worker_without_cores_claims_one_and_says_so(monkeypatch, caplog) -> None:
    from pdserve.worker import engine
    from pdserve.worker.main import claim_cores

    monkeypatch.setattr(engine, "is_cpu_host", lambda: True)
    mine = os.sched_getaffinity(0)
    with caplog.at_level(logging.INFO, logger="pdserve.worker"):
        first = claim_cores(None)
        shared = [claim_cores(None) for _ in mine]  # every core taken: the next ones share
    assert first.cores[0] in mine and first.others == 0
    assert shared[-1].others == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 + len(mine)
    assert f"took core {first.spec}" in lines[0]
    assert f"sharing core {shared[-1].spec} with 1 other" in lines[-1]


def test_a_cpu_worker_given_cores_records_them(monkeypatch) -> None:
    from pdserve.worker import engine
    from pdserve.worker.main import claim_cores

    monkeypatch.setattr(engine, "is_cpu_host", lambda: True)
    held = claim_cores("0-1")
    assert held.cores == [0, 1] and cores.holders(0) == cores.holders(1) == 1
    assert claim_cores("x") is None  # pin() refuses the list with its reason


def test_a_worker_on_another_host_claims_nothing(monkeypatch, lock_dir: str) -> None:
    from pdserve.worker import engine
    from pdserve.worker.main import claim_cores

    monkeypatch.setattr(engine, "is_cpu_host", lambda: False)
    assert claim_cores(None) is None
    assert claim_cores("0") is None
    assert not os.path.exists(lock_dir)


def test_an_unusable_lock_folder_stops_a_worker_with_a_reason(monkeypatch, tmp_path) -> None:
    from pdserve.worker import engine
    from pdserve.worker.main import claim_cores

    (tmp_path / "file").write_text("")
    monkeypatch.setenv(cores.LOCK_DIR_ENV, str(tmp_path / "file" / "locks"))
    monkeypatch.setattr(engine, "is_cpu_host", lambda: True)
    with pytest.raises(SystemExit, match="cannot claim a core"):
        claim_cores(None)
    assert claim_cores("0") is None  # given cores still work, unrecorded


def test_a_stuck_claimer_does_not_hang_the_next_one(monkeypatch, lock_dir: str) -> None:
    cores.claim(cpus={0})  # makes the folder
    stuck = os.open(os.path.join(lock_dir, "claiming"), os.O_RDONLY)
    try:
        fcntl.flock(stuck, fcntl.LOCK_EX)  # as if a worker were stopped while choosing
        monkeypatch.setattr(cores, "CHOOSE_TIMEOUT", 0.2)
        c = cores.claim(cpus={0, 1})
        assert c.cores == [1]
    finally:
        os.close(stuck)


def test_the_worker_command_without_cores_runs_on_the_core_it_claimed(lock_dir: str) -> None:
    """`pdserve worker` up to building its engine (vLLM is imported, no engine is started)."""
    code = ("import asyncio, os, sys\n"
            "import pdserve.worker.main as m\n"
            "async def run(args, starting):\n"
            "    print(args.cores, sorted(os.sched_getaffinity(0)), flush=True)\n"
            "    return 0\n"
            "m.run = run\n"
            "from pdserve.cli import main\n"
            "sys.exit(main(['worker', '--role', 'decode', '--controller', 'tcp://127.0.0.1:9',\n"
            "               '--model', 'unused']))\n")
    taken = cores.claim()  # another worker holds one core: this one takes a free one if any
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    spec, affinity = out.stdout.split(" ", 1)
    assert affinity.strip() == f"[{spec}]"  # pinned, as with --cores
    mine = os.sched_getaffinity(0)
    if len(mine) > 1:
        assert int(spec) in mine - set(taken.cores)
        assert f"no --cores: took core {spec}" in out.stderr
    else:
        assert f"sharing core {spec} with 1 other" in out.stderr
    assert out.stderr.count("no --cores") == 1  # one line says so
