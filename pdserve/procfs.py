"""Processes and the /dev/shm files they use, read from /proc (`proc` and `folder` are seams for
tests). vLLM's engines talk through shared memory and lock with multiprocessing's named
semaphores (`sem.mp-*`), so what a stopped engine left there is found by asking which files no
process uses any more."""

from __future__ import annotations

import os
import select
import stat
import threading
from collections.abc import Callable
from pathlib import Path

PROC, SHM = Path("/proc"), Path("/dev/shm")


def children(pid: int, proc: Path = PROC) -> list[int]:
    out: list[int] = []
    try:
        for task in (proc / str(pid) / "task").iterdir():
            out += [int(x) for x in (task / "children").read_text().split()]
    except OSError:
        pass  # gone
    return out


def tree_of(roots: list[int], proc: Path = PROC) -> list[int]:
    return [p for r in roots for p in tree(r, proc)]


def tree(pid: int, proc: Path = PROC) -> list[int]:
    """`pid` and its descendants (an engine keeps to a process group of its own, so process
    groups do not find it; parentage does)."""
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < 1000:
        p = todo.pop(0)
        if p not in out:
            out.append(p)
            todo += children(p, proc)
    return out


def shm_segments(folder: Path = SHM) -> dict[str, tuple[int, float]]:
    """Shared-memory files (vLLM's engines talk through some): name -> (bytes, mtime)."""
    return {name: (st.st_size, st.st_mtime) for name, st in _files(folder).items()}


def _files(folder: Path) -> dict[str, os.stat_result]:
    """The regular files in `folder` (none if it cannot be read), by name."""
    out = {}
    try:
        for f in folder.iterdir():
            try:
                st = f.stat()
            except OSError:
                continue  # gone meanwhile
            if stat.S_ISREG(st.st_mode):
                out[f.name] = st
    except OSError:
        pass
    return out


def shm_used(pids: list[int] | None = None, folder: Path = SHM,
             proc: Path = PROC) -> set[str]:
    """Names of the files in `folder` that the processes `pids` (None: every process) map or
    hold open. A mapping is known by its device and inode before its path: glibc makes a named
    semaphore under a temporary name and maps it as that (`sem.XXXXXX (deleted)`), then links
    it to its own (`sem.mp-...`, multiprocessing's)."""
    prefix = f"{folder}/"
    entries = ([proc / str(p) for p in pids] if pids is not None
               else [e for e in proc.iterdir() if e.name.isdigit()])
    inodes = _inodes(folder)
    used: set[str] = set()
    for entry in entries:
        try:
            maps = [line.split(maxsplit=5) for line in (entry / "maps").read_text().splitlines()]
            paths = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue  # gone, or not ours to read
        for m in maps:
            if len(m) == 6 and m[5].startswith(prefix):
                name = inodes.get((m[3], int(m[4])))
                paths.append(prefix + name if name else m[5])
        used |= {x.removesuffix(" (deleted)")[len(prefix):] for x in paths
                 if x.startswith(prefix)}
    return used


def _inodes(folder: Path) -> dict[tuple[str, int], str]:
    """(device as /proc/PID/maps writes it, inode) -> name, of the files in `folder`."""
    return {(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino): name
            for name, st in _files(folder).items()}


def alive(pid: int, proc: Path = PROC) -> bool:
    """Running (a zombie, exited but not yet reaped, is not)."""
    return started(pid, proc) is not None


def started(pid: int, proc: Path = PROC) -> int | None:
    """When a running process started (clock ticks after boot): with its pid, which process it
    is, since pids are reused; None if it is gone or a zombie."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()  # rest[0] is field 3 (state), starttime is 22
    return None if rest[0] in ("Z", "X") else int(rest[19])


TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int], proc: Path = PROC) -> float:
    """CPU time the processes have used so far, user and system, all their threads (one gone
    counts nothing)."""
    ticks = 0
    for pid in pids:
        try:
            text = (proc / str(pid) / "stat").read_text()
        except OSError:
            continue
        rest = text[text.rindex(")") + 2:].split()  # rest[0] is field 3: utime is 14, stime 15
        ticks += int(rest[11]) + int(rest[12])
    return ticks / TICKS_PER_S


def on_parent_exit(pid: int, then: Callable[[], None], name: str) -> bool:
    """Call `then` in a thread of its own (named `name`) once process `pid`, this process's
    parent, has exited. False, with nothing watched, when `pid` is not this process's parent
    any more: it exited already (its pid may be another process's by now)."""
    try:
        exited = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    if os.getppid() != pid:  # it exited before the fd was opened
        os.close(exited)
        return False

    def wait() -> None:
        select.select([exited], [], [])  # readable once the process has exited
        then()

    threading.Thread(target=wait, name=name, daemon=True).start()
    return True
