"""What a killed child's processes leave in /dev/shm is removed once nothing uses it: from a fake
/proc first, then a real process group killed with SIGKILL under the supervisor."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from procs import gone

from pdserve import procfs
from pdserve.leftovers import (SOCKET_PATH_MAX, VLLM_SOCKET_NAME, Leftovers, stale_temp,
                               temp_env)
from pdserve.procfs import SHM
from pdserve.supervisor import Backoff, Child, Supervisor


def _stat(pid: int, state: str, started: int = 1000) -> str:
    """A /proc/PID/stat line: state is field 3, when it started field 22."""
    return f"{pid} (python) {state} 1 {pid} " + "0 " * 16 + f"{started} 0\n"


class FakeProc:
    """/proc and /dev/shm in a folder: processes that map files and have children."""

    def __init__(self, root: Path):
        self.proc, self.shm = root / "proc", root / "shm"
        self.proc.mkdir()
        self.shm.mkdir()

    def file(self, name: str) -> None:
        (self.shm / name).write_bytes(b"x" * 32)

    def process(self, pid: int, maps: list[str], children: list[int] = ()) -> None:
        p = self.proc / str(pid)
        (p / "task" / str(pid)).mkdir(parents=True, exist_ok=True)
        (p / "fd").mkdir(exist_ok=True)
        (p / "task" / str(pid) / "children").write_text(" ".join(map(str, children)))
        (p / "stat").write_text(_stat(pid, "S"))
        (p / "maps").write_text("".join(f"7f00-7f10 rw-s 00000000 00:1a {i + 40} {self.shm}/{m}\n"
                                        for i, m in enumerate(maps)))

    def exit(self, pid: int) -> None:
        """A zombie: it maps nothing any more."""
        (self.proc / str(pid) / "stat").write_text(_stat(pid, "Z"))
        (self.proc / str(pid) / "maps").write_text("")

    def left(self) -> set[str]:
        return {f.name for f in self.shm.iterdir()}


@pytest.fixture
def fake(tmp_path) -> FakeProc:
    return FakeProc(tmp_path)


def test_a_killed_childs_files_go_once_its_processes_are_gone_and_nothing_uses_them(fake, caplog):
    for name in ("sem.mp-engine", "psm_queue", "shared", "not_ours"):
        fake.file(name)
    (fake.shm / "pdserve-cores").mkdir()
    fake.file("pdserve-cores/core1.0")  # a core claim: kept for good
    fake.process(10, ["psm_queue", "shared", "pdserve-cores/core1.0"], children=[11])  # worker
    fake.process(11, ["sem.mp-engine"])  # its engine core
    fake.process(20, ["shared"])  # another process, using one of the same files
    left = Leftovers(every=0, folder=fake.shm, proc=fake.proc)
    left.note("decode-1", 10, now=0.0)
    fake.exit(10)
    left.ended(10, now=1.0)
    assert left.sweep(now=1.5) == [] and left.pending()  # the engine core is still ending
    assert fake.left() == {"sem.mp-engine", "psm_queue", "shared", "not_ours", "pdserve-cores"}
    fake.exit(11)
    (fake.shm / "psm_queue").unlink()  # its resource tracker got to this one
    with caplog.at_level(logging.WARNING, logger="pdserve.serve"):
        assert left.sweep(now=2.0) == ["sem.mp-engine"]
    assert not left.pending()
    assert fake.left() == {"shared", "not_ours", "pdserve-cores"}
    assert (fake.shm / "pdserve-cores" / "core1.0").exists()
    assert f"removed what decode-1's processes left in {fake.shm}: sem.mp-engine" in caplog.text


def test_files_are_looked_at_less_often_as_a_child_runs_on(fake):
    fake.file("early")
    fake.process(10, ["early"])
    left = Leftovers(every=5, most=20, folder=fake.shm, proc=fake.proc)
    for t in range(0, 61):  # the supervisor's checks, once a second
        fake.file(f"t{t}")
        fake.process(10, ["early", f"t{t}"])  # a file of its own, each second
        left.note("prefill-1", 10, now=float(t))
    looks = sorted(int(f[1:]) for f in left._running[10].files if f.startswith("t"))
    assert looks == [0, 5, 15, 35, 55]  # waits of 5, 10, 20, 20
    fake.exit(10)
    left.ended(10, now=61.0)
    assert left.sweep(now=61.0) == sorted(["early", "t0", "t15", "t35", "t5", "t55"])

    left.note("prefill-2", 30, now=70.0)  # a process already gone: nothing to note or remove
    left.ended(30, now=70.0)
    assert not left.pending()


def test_a_forced_look_sees_what_started_since_the_last(fake):
    fake.process(10, [])
    left = Leftovers(every=5, folder=fake.shm, proc=fake.proc)
    left.note("decode-1", 10, now=0.0)
    fake.file("sem.mp-engine")
    fake.process(11, ["sem.mp-engine"])  # its engine, started a moment later
    (fake.proc / "10" / "task" / "10" / "children").write_text("11")
    left.note("decode-1", 10, now=1.0, force=True)  # as serve stops
    fake.exit(10)
    fake.exit(11)
    left.ended(10, now=1.0)
    assert left.sweep(now=1.0) == ["sem.mp-engine"]


def test_a_file_new_in_the_folder_has_the_children_looked_at_again(fake):
    """A worker's engine starts 20 s in and makes its semaphore at 35.5 s, between the looks
    the backoff plans (0, 5, 15, 35, 75): the folder's new name gets it looked at, once a
    second at most, and the semaphore is known when both die by SIGKILL at 40 s."""
    fake.process(10, [])
    left = Leftovers(every=5, most=120, least=1, folder=fake.shm, proc=fake.proc)
    looks = []
    for t in [x / 2 for x in range(81)]:  # the supervisor's checks, twice a second
        if t == 20:
            fake.process(10, [], children=[11])
            fake.process(11, [])
        if t == 35.5:
            fake.file("sem.mp-engine")
            fake.process(11, ["sem.mp-engine"])
        left.glance(t)
        left.note("decode-1", 10, now=t)
        if left._running[10].at == t:
            looks.append(t)
    assert looks == [0, 5, 15, 35, 36]
    fake.exit(10)
    fake.exit(11)
    left.ended(10, now=40.0)
    assert left.sweep(now=40.0) == ["sem.mp-engine"]


def test_a_process_that_outlives_its_patience_keeps_its_files(fake, caplog):
    fake.file("sem.mp-engine")
    fake.process(10, [], children=[11])
    fake.process(11, ["sem.mp-engine"])
    left = Leftovers(every=0, patience=60, folder=fake.shm, proc=fake.proc)
    left.note("decode-1", 10, now=0.0)
    fake.exit(10)
    left.ended(10, now=0.0)
    fake.process(11, [])  # still running, no longer mapping it
    assert left.sweep(now=59.0) == [] and left.pending()
    with caplog.at_level(logging.WARNING, logger="pdserve.serve"):
        assert left.sweep(now=60.0) == []
    assert not left.pending() and fake.left() == {"sem.mp-engine"}
    assert "decode-1's processes [11] still run 60 s after it exited" in caplog.text


def test_a_reused_pid_is_not_one_of_its_processes(fake):
    fake.file("sem.mp-engine")
    fake.process(10, [], children=[11])
    fake.process(11, ["sem.mp-engine"])
    left = Leftovers(every=0, folder=fake.shm, proc=fake.proc)
    left.note("decode-1", 10, now=0.0)
    fake.exit(10)
    left.ended(10, now=0.0)
    (fake.proc / "11" / "stat").write_text(_stat(11, "S", started=5000))  # another process now
    (fake.proc / "11" / "maps").write_text("")
    assert left.stop_left() == []  # not ours to stop
    assert left.sweep(now=1.0) == ["sem.mp-engine"]


def semaphore_holder(after: float = 0.0) -> list[str]:
    """A worker's stand-in: a named semaphore as an engine core makes one `after` seconds into
    its start (multiprocessing's spawn context keeps it named, registered with a resource
    tracker in this group), its name printed."""
    return [sys.executable, "-c",
            f"import multiprocessing, time\ntime.sleep({after})\n"
            "lock = multiprocessing.get_context('spawn').Lock()\n"
            "print(lock._semlock.name, flush=True); time.sleep(300)\n"]


@pytest.fixture
def spawn():
    """A Supervisor's spawn: each child in a process group of its own, its output piped; every
    group is SIGKILLed and reaped afterwards."""
    children: list[Child] = []

    def start(name: str, cmd: list[str]) -> Child:
        children.append(Child(name, subprocess.Popen(cmd, start_new_session=True,
                                                     stdout=subprocess.PIPE, text=True)))
        return children[-1]

    yield start
    for c in children:
        c.signal_group(signal.SIGKILL)
        c.proc.wait(30)
        c.proc.stdout.close()


def test_the_supervisor_removes_the_semaphore_a_group_killed_with_sigkill_left(spawn, caplog):
    sup = Supervisor(spawn, backoff=lambda: Backoff(first=300),
                     leftovers=Leftovers(every=0))
    files: list[str] = []
    killed, stopped = sup.start("decode-1", semaphore_holder()), sup.start("decode-2",
                                                                            semaphore_holder())
    try:
        sems = [c.proc.stdout.readline().strip().lstrip("/") for c in (killed, stopped)]
        files += [f"sem.{s}" for s in sems]
        assert all((SHM / f).exists() for f in files)
        sup.check()  # notes what each uses
        os.killpg(killed.proc.pid, signal.SIGKILL)  # kill -9 of the whole group: the tracker too
        killed.proc.wait(30)
        assert (SHM / files[0]).exists()  # nothing else would ever remove it
        deadline = time.monotonic() + 30
        with caplog.at_level(logging.WARNING, logger="pdserve.serve"):
            while (SHM / files[0]).exists() and time.monotonic() < deadline:
                sup.check()
                time.sleep(0.05)
        assert not (SHM / files[0]).exists()
        assert f"removed what decode-1's processes left in {SHM}: {files[0]}" in caplog.text
        assert (SHM / files[1]).exists()  # decode-2 still runs

        # Stopped for good with SIGKILL (what a second Ctrl-C does): swept as serve ends.
        stopped.signal_group(signal.SIGKILL)
        stopped.proc.wait(30)
        sup.stop(drain_timeout=1, timeout=30)
        assert not (SHM / files[1]).exists()
    finally:
        for f in files:
            (SHM / f).unlink(missing_ok=True)


def test_a_semaphore_made_between_the_planned_looks_is_removed_after_sigkill(spawn):
    """The backoff's next look is a minute away: the folder's new file gets the child looked
    at, so a kill -9 of its group right after leaves nothing."""
    sup = Supervisor(spawn, backoff=lambda: Backoff(first=300),
                     leftovers=Leftovers(every=60, least=1))
    child = sup.start("decode-1", semaphore_holder(after=1))
    f = ""
    try:
        sup.check()  # its first look: no semaphore yet
        f = "sem." + child.proc.stdout.readline().strip().lstrip("/")
        end = time.monotonic() + 1.5  # past `least` since that look
        while time.monotonic() < end:
            sup.check()
            time.sleep(0.1)
        child.signal_group(signal.SIGKILL)
        child.proc.wait(30)
        deadline = time.monotonic() + 30
        while (SHM / f).exists() and time.monotonic() < deadline:
            sup.check()
            time.sleep(0.05)
        assert not (SHM / f).exists()
    finally:
        if f:
            (SHM / f).unlink(missing_ok=True)


# A worker whose engine core, in a process group of its own, maps the worker's semaphore.
WORKER_AND_ENGINE = """
import multiprocessing, os, time

def engine(lock):
    os.setpgid(0, 0)
    time.sleep(300)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    core = ctx.Process(target=engine, args=(lock,))
    core.start()
    time.sleep(3)  # the engine has opened the semaphore
    print(lock._semlock.name, core.pid, flush=True)
    time.sleep(300)
"""


def test_stopping_serve_stops_an_engine_that_outlived_its_killed_worker(spawn, tmp_path,
                                                                        caplog):
    """A second Ctrl-C SIGKILLs a worker's group; its engine core, in a group of its own, would
    stop only ~20 s later, and the semaphore would stay: serve stops it and removes the file."""
    (tmp_path / "worker.py").write_text(WORKER_AND_ENGINE)
    sup = Supervisor(spawn, leftovers=Leftovers(every=0))
    w = sup.start("decode-1", [sys.executable, str(tmp_path / "worker.py")])
    sem, engine = w.proc.stdout.readline().split()
    f, engine_pid = f"sem.{sem.lstrip('/')}", int(engine)
    try:
        sup.check()  # notes what its processes use
        w.signal_group(signal.SIGKILL)
        w.proc.wait(30)
        # The rest of its group (multiprocessing's resource tracker) may still be dying, and
        # would be stopped too: the engine core, in a group of its own, is the one meant here.
        gone(w.proc.pid)
        assert procfs.alive(engine_pid) and (SHM / f).exists()
        with caplog.at_level(logging.WARNING, logger="pdserve.serve"):
            sup.stop(drain_timeout=1)
        assert not procfs.alive(engine_pid)
        assert not (SHM / f).exists()
        assert f"stopping what is left of decode-1's processes: [{engine_pid}]" in caplog.text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine_pid, signal.SIGKILL)
        (SHM / f).unlink(missing_ok=True)


def test_what_killed_processes_left_in_the_temporary_folder_goes_once_they_are_gone(tmp_path):
    """A serve or a worker killed with SIGKILL leaves its folder, a worker's engine killed so its
    KV-event sockets: named by their maker's pid, they go once it is gone, and nothing else
    does."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = os.getpid()
    for name in (f"pdserve-serve-{dead.pid}-abc", f"pdserve-serve-{me}-def",
                 f"pdserve-worker-{dead.pid}-ghi", f"pdserve-worker-{me}-jkl"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keys").write_text("k")
    for name in (f"pdserve-kv-{dead.pid}", f"pdserve-kv-{dead.pid}-replay", f"pdserve-kv-{me}",
                 "pdserve-kv-x", f"other-{dead.pid}"):
        (tmp_path / name).write_text("")
    assert sorted(stale_temp(tmp_path)) == sorted([
        f"pdserve-serve-{dead.pid}-abc", f"pdserve-worker-{dead.pid}-ghi",
        f"pdserve-kv-{dead.pid}", f"pdserve-kv-{dead.pid}-replay"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        f"pdserve-serve-{me}-def", f"pdserve-worker-{me}-jkl", f"pdserve-kv-{me}",
        "pdserve-kv-x", f"other-{dead.pid}"])


def test_childrens_temporary_files_go_to_a_folder_but_torchs_compile_cache_stays_shared(
        tmp_path, monkeypatch):
    """A child's temporary files go with its run's folder; torch inductor's cache stays where
    every run finds it, and so do the precompiled headers an engine builds as it starts (~150
    MB), which torch keeps in its default cache folder in TMPDIR whatever the cache's setting."""
    where = ("import os, tempfile; from torch._inductor.runtime.cache_dir_utils import cache_dir; "
             "from torch._inductor.codecache import _HEADER_DIR; "
             "print(tempfile.gettempdir()); print(cache_dir()); print(os.path.realpath(_HEADER_DIR))")

    def ask(env: dict[str, str]) -> list[str]:
        return subprocess.run([sys.executable, "-c", where], env=env, capture_output=True,
                              text=True, check=True, timeout=120).stdout.split()

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = dict(os.environ)
    plain_temp, plain_cache, plain_headers = ask(env)
    assert plain_headers == os.path.realpath(Path(plain_cache) / "precompiled_headers")
    run = tmp_path / "run"
    run.mkdir()
    assert ask(dict(env, **temp_env(run))) == [str(run), plain_cache, plain_headers]
    assert plain_temp != str(run)
    shutil.rmtree(run)  # as serve removes its folder: the link goes, the shared cache stays
    assert Path(plain_cache).is_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice
    assert temp_env(tmp_path)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_vllms_sockets_stay_where_they_were_when_the_folder_leaves_them_no_room(tmp_path,
                                                                                monkeypatch):
    """vLLM names a socket <folder>/<uuid4>, and a socket's path must fit in 107 bytes: in a
    folder with too long a path for that, the engine could not start."""
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    room = SOCKET_PATH_MAX - VLLM_SOCKET_NAME
    fits = "/" + "f" * (room - 1)
    too_long = "/" + "l" * room
    assert temp_env(fits)["VLLM_RPC_BASE_PATH"] == fits
    assert temp_env(too_long)["VLLM_RPC_BASE_PATH"] == str(tmp_path)
    assert temp_env(too_long)["TMPDIR"] == too_long  # files other than sockets still go there
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/run/mine")  # the user's choice
    assert temp_env(fits)["VLLM_RPC_BASE_PATH"] == "/run/mine"
