"""What a killed child leaves in /dev/shm, found and removed.

An engine core makes a named semaphore (`sem.mp-*`). It unlinks it when it stops, and if it is
killed, multiprocessing's resource tracker in its worker's process group does. When both die by
SIGKILL (a second Ctrl-C to `pdserve serve`, a stop that ran out of time, kill -9 of a worker's
group and of its engine core's), the file stays until the machine restarts. So the supervisor
notes the files each child's processes use while they run, and once the child has exited and
none of those processes is left, removes those of its files that no process uses any more.

The temporary folder gets its own: a `pdserve serve` killed with SIGKILL leaves its folder
(keys, and its children's temporary files, which it keeps there), and a worker started on its
own its folder (vLLM's sockets, the engine's KV-event sockets); each is named by the pid of the
process that made it, and removed by the next `pdserve serve` once that process is gone
(`stale_temp`).
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.procfs import PROC, SHM, shm_used, started, tree

logger = logging.getLogger("pdserve.serve")


@dataclass
class _Noted:
    name: str
    files: set[str] = field(default_factory=set)
    pids: dict[int, int] = field(default_factory=dict)  # pid -> when it started
    at: float = float("-inf")  # when last looked at
    wait: float = 0.0  # until the next look
    until: float = 0.0  # after its exit: when to stop waiting for its processes to end


class Leftovers:
    """Per child (by its pid): the /dev/shm files its process tree was seen using. A look costs
    ~10 ms of /proc reading per worker, so a child is looked at when the folder has gained a
    file since its last look (`glance`, one listing; at most once in `least` seconds), and
    otherwise `every` seconds after it started, then twice as long after each look up to
    `most`. After its exit, `sweep` removes its files once nothing uses them, or gives up after
    `patience` seconds of its processes still running."""

    def __init__(self, every: float = 5.0, most: float = 120.0, patience: float = 120.0,
                 least: float = 1.0, folder: Path = SHM, proc: Path = PROC):
        self.every, self.most, self.patience, self.least = every, most, patience, least
        self.folder, self.proc = folder, proc
        self._running: dict[int, _Noted] = {}
        self._ended: list[_Noted] = []
        self._names: set[str] = set()
        self._grew = float("-inf")  # when the folder last gained a name

    def glance(self, now: float) -> None:
        """List the folder: a name it did not have at the last glance makes every child due for
        a look. An engine makes its semaphore seconds into its start, which the backoff alone
        could leave unseen for a minute, while a stuck start is what gets killed."""
        try:
            names = set(os.listdir(self.folder))
        except OSError:
            names = set()
        if names - self._names:
            self._grew = now
        self._names = names

    def note(self, name: str, pid: int, now: float, force: bool = False) -> None:
        """Look at what `pid`'s processes use, if its next look is due (or `force`)."""
        n = self._running.setdefault(pid, _Noted(name))
        grew = n.at < self._grew and now - n.at >= self.least
        if force or grew or now - n.at >= n.wait:
            pids = tree(pid, self.proc)
            # Only the folder's own files: the workers' core claims live in a folder of theirs
            # there and stay by design (pdserve/worker/cores.py).
            n.files |= {f for f in shm_used(pids, self.folder, self.proc) if "/" not in f}
            for p in pids:
                if (t := started(p, self.proc)) is not None:
                    n.pids.setdefault(p, t)
            n.at, n.wait = now, min(self.most, max(self.every, 2 * n.wait))

    def ended(self, pid: int, now: float) -> None:
        if (n := self._running.pop(pid, None)) is not None and n.files:
            n.until = now + self.patience
            self._ended.append(n)

    def pending(self) -> bool:
        return bool(self._ended)

    def sweep(self, now: float) -> list[str]:
        """Remove the files of ended children whose processes are all gone and that no process
        uses; returns their names."""
        removed: list[str] = []
        for n in list(self._ended):
            if running := self._running_of(n):
                if now >= n.until:
                    self._ended.remove(n)
                    logger.warning("%s's processes %s still run %g s after it exited; not "
                                   "removing its /dev/shm files %s", n.name, running,
                                   self.patience, sorted(n.files))
                continue
            self._ended.remove(n)
            gone = self._remove(n.files - shm_used(None, self.folder, self.proc))
            if gone:
                logger.warning("removed what %s's processes left in %s: %s", n.name,
                               self.folder, ", ".join(gone))
            removed += gone
        return removed

    def stop_left(self) -> list[int]:
        """SIGKILL what still runs of the ended children's processes (an engine core in a
        process group of its own outlives its worker's SIGKILL for a while); their pids."""
        out = []
        for n in self._ended:
            if running := self._running_of(n):
                logger.warning("stopping what is left of %s's processes: %s", n.name, running)
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out += running
        return out

    def _running_of(self, n: _Noted) -> list[int]:
        """Those of its processes still running (the same pid started at the same time)."""
        return sorted(p for p, t in n.pids.items() if started(p, self.proc) == t)

    def _remove(self, names: set[str]) -> list[str]:
        out = []
        for name in sorted(names):
            try:
                (self.folder / name).unlink()
            except FileNotFoundError:
                continue  # its tracker did unlink it
            except OSError as e:
                logger.warning("could not remove %s: %s", self.folder / name, e)
                continue
            out.append(name)
        return out


# In the temporary folder, by the pid of their maker: serve's folder (launcher.py), a worker's
# own (worker/main.py, when started on its own), its engine's KV-event sockets
# (worker/kv_events.py).
_TEMP = re.compile(r"pdserve-(?:serve|worker)-(\d+)-.*|pdserve-kv-(\d+)(-replay)?")


def stale_temp(folder: Path | None = None, proc: Path = PROC) -> list[str]:
    """Remove this user's pdserve files in the temporary folder whose maker is gone; their
    names."""
    folder = folder or Path(tempfile.gettempdir())
    removed = []
    for path in folder.iterdir():
        m = _TEMP.fullmatch(path.name)
        if m is None or started(int(m.group(1) or m.group(2)), proc) is not None:
            continue
        with contextlib.suppress(OSError):
            if path.lstat().st_uid != os.getuid():
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path.name)
    return removed


def torch_cache_name() -> str:
    """The name of torch's default cache folder in the temporary folder, as torch makes it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (an arbitrary container user)
        user = f"uid_{os.getuid()}"
    return "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)


def shared_torch_cache() -> str:
    """Torch inductor's cache folder as this process's children would find it by themselves:
    the user's TORCHINDUCTOR_CACHE_DIR, else torch's default in the temporary folder."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), torch_cache_name())


def share_torch_cache(folder: str | Path, shared: str) -> None:
    """Have torch's default cache folder in `folder` be `shared`, by a link. Torch keeps the
    C++ precompiled headers an engine builds as it starts (~150 MB, ~7 s of a core) in its
    default cache folder in TMPDIR whatever TORCHINDUCTOR_CACHE_DIR says, so children whose
    TMPDIR is a run's own folder built them again at every run. Removing the folder removes
    the link, not what it points to."""
    with contextlib.suppress(OSError):  # no shared cache then: the children build their own
        os.makedirs(shared, exist_ok=True)
        os.symlink(shared, os.path.join(folder, torch_cache_name()))


# vLLM names its IPC sockets <folder>/<uuid4>, and a socket's path must fit in sockaddr_un:
# a longer one stops the engine's start (ZMQError "ipc path ... is longer than 107 characters").
SOCKET_PATH_MAX = 107
VLLM_SOCKET_NAME = 1 + 36  # "/" and a uuid4


def temp_env(folder: str | Path) -> dict[str, str]:
    """Environment for children whose temporary files go in `folder` and with it: vLLM's
    sockets (unless the user placed them, or their paths would be too long there) and file
    store, the KV-event sockets. Torch inductor's cache stays where every run shares it,
    its precompiled headers included (`share_torch_cache`, which this sets up in `folder`)."""
    inductor = shared_torch_cache()
    share_torch_cache(folder, inductor)
    sockets = os.environ.get("VLLM_RPC_BASE_PATH") or (
        str(folder) if len(os.fsencode(folder)) + VLLM_SOCKET_NAME <= SOCKET_PATH_MAX
        else tempfile.gettempdir())
    return {"TMPDIR": str(folder), "TORCHINDUCTOR_CACHE_DIR": inductor,
            "VLLM_RPC_BASE_PATH": sockets}
