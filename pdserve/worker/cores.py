"""Host-local core claims, so CPU workers started without `--cores` spread over the cores.

A claim is an flock'ed lock file per (core, slot) in a host-wide folder: `core3.0` is the first
holder of core 3, `core3.1` a second one sharing it. The lock lives with the open file
description, so the kernel releases it when the worker exits, crashes or is killed with SIGKILL;
nothing needs cleaning up and stale files are free again. Holders of a core are counted by
trying each of its files. Choosing is serialized by one more lock (`claiming`), so two workers
starting together never both see a core as free.

The engine's processes must not keep a dead worker's claim: vLLM spawns its engine core on CPU
hosts (fork + exec, and these descriptors are close-on-exec), and a plain fork of this process
closes them in the child (see `_close_all`). An orphaned engine core that lingers after its
worker was killed therefore holds no claim, though it may still use the core until it is stopped.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

LOCK_DIR_ENV = "PDSERVE_CORE_LOCK_DIR"
# A tmpfs every user can write (not $TMPDIR, which differs between processes): host-wide, and
# emptied at boot. Inside a container with a private /dev/shm the claims are per container.
DEFAULT_LOCK_DIR = "/dev/shm/pdserve-cores"
CHOOSE_TIMEOUT = 10.0  # seconds to wait for another worker's choice (it takes microseconds)

_held: set[int] = set()  # descriptors of this process's claims


@dataclass
class Claim:
    """Cores this process holds until it exits (or `release()`)."""

    cores: list[int]
    others: int  # most other holders on any of these cores when claimed (0: all were free)
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def spec(self) -> str:
        """As `--cores` and VLLM_CPU_OMP_THREADS_BIND take them, e.g. "0,2"."""
        return ",".join(map(str, self.cores))

    def release(self) -> None:
        for fd in self._fds:
            if fd in _held:  # not already closed in a forked child
                _held.discard(fd)
                os.close(fd)
        self._fds.clear()


def lock_dir() -> str:
    return os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR


def claim(count: int = 1, cpus: set[int] | None = None, folder: str | None = None) -> Claim:
    """Claim `count` of `cpus` (default: the cores this process may use): the ones fewest
    other pdserve workers on this host hold, free ones first, lowest id on a tie."""
    cpus = set(os.sched_getaffinity(0) if cpus is None else cpus)
    if not cpus or count < 1:
        raise ValueError(f"cannot claim {count} of cores {sorted(cpus)}")
    folder = _ensure(folder or lock_dir())
    with _choosing(folder):
        counts = {c: holders(c, folder) for c in cpus}
        chosen = sorted(cpus, key=lambda c: (counts[c], c))[:count]
        return Claim(sorted(chosen), max(counts[c] for c in chosen),
                     [_take_slot(folder, c) for c in chosen])


def hold(cores: set[int], folder: str | None = None) -> Claim:
    """Record cores this process was given (`--cores`), so workers that claim see them taken."""
    folder = _ensure(folder or lock_dir())
    with _choosing(folder):
        others = max((holders(c, folder) for c in cores), default=0)
        return Claim(sorted(cores), others, [_take_slot(folder, c) for c in sorted(cores)])


def holders(core: int, folder: str | None = None) -> int:
    """How many live processes hold `core` (a process's own claims count too)."""
    folder = folder or lock_dir()
    prefix = f"core{core}."
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except FileNotFoundError:
        return 0
    return sum(_locked(os.path.join(folder, n)) for n in names)


def _ensure(folder: str) -> str:
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
        try:
            os.chmod(folder, 0o1777)  # like /tmp: every user's workers share one view of the host
        except PermissionError:
            pass  # another user made it meanwhile
    return folder


def _open(path: str) -> int:
    # Read-only is enough for flock, and lets other users' workers lock files this one created.
    return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def _try_lock(path: str) -> int | None:
    """A descriptor holding an exclusive lock on `path`, or None if another holds it."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _locked(path: str) -> bool:
    fd = _try_lock(path)
    if fd is None:
        return True
    os.close(fd)
    return False


def _take_slot(folder: str, core: int) -> int:
    slot = 0
    while True:
        fd = _try_lock(os.path.join(folder, f"core{core}.{slot}"))
        if fd is not None:
            _held.add(fd)
            return fd
        slot += 1


@contextmanager
def _choosing(folder: str) -> Iterator[None]:
    """The folder's choosing lock, waited for at most CHOOSE_TIMEOUT. Past that (a holder
    stopped with SIGSTOP, say) choose anyway: the slot locks still keep one holder per slot,
    only the balance between racing workers is no longer guaranteed."""
    path = os.path.join(folder, "claiming")
    deadline = time.monotonic() + CHOOSE_TIMEOUT
    while (fd := _try_lock(path)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _close_all() -> None:
    for fd in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


# A forked child shares the locks with its parent; closing its copies leaves the claims with the
# parent alone, so they end when the parent does.
os.register_at_fork(after_in_child=_close_all)
