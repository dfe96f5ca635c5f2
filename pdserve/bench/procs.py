"""CPU time of whole process groups, read from /proc (a worker's engine runs in child processes),
and the benchmarks' other process helpers: waiting for a quiet machine, signals that unwind.

Only processes alive when sampled are counted: CPU of a process that exits between two samples
is lost, which is fine for the long-lived engines measured here.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from pdserve.net import free_port  # noqa: F401  (bench.soak takes it from here)

TICKS = os.sysconf("SC_CLK_TCK")


def parse_stat(text: str) -> tuple[int, int, float]:
    """(pid, pgrp, utime + stime in seconds) from the text of /proc/<pid>/stat."""
    pid = int(text[: text.index(" ")])
    rest = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parens
    # rest[0] is field 3 (state): pgrp is field 5, utime 14, stime 15.
    return pid, int(rest[2]), (int(rest[11]) + int(rest[12])) / TICKS


def _ppid(text: str) -> int:
    return int(text[text.rindex(")") + 2:].split()[1])


def group_cpu(pgids: Iterable[int], proc: Path = Path("/proc")) -> dict[int, float]:
    """CPU seconds used so far by the live processes of each process group, and of the groups
    its processes started below them: a worker's engine core leads a group of its own
    (worker/engine_proc.py) and is counted with its worker."""
    wanted = set(pgids)
    totals = dict.fromkeys(wanted, 0.0)
    stats: dict[int, tuple[int, int, float]] = {}  # pid -> (ppid, pgrp, cpu)
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
            pid, pgrp, cpu = parse_stat(text)
            stats[pid] = (_ppid(text), pgrp, cpu)
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    for pid, (ppid, pgrp, cpu) in stats.items():
        seen = 0
        while pgrp not in wanted and ppid in stats and seen < 64:  # the nearest wanted ancestor
            ppid, pgrp, _ = stats[ppid]
            seen += 1
        if pgrp in wanted:
            totals[pgrp] += cpu
    return totals


def group_pids(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    pids = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                pid, pgrp, _ = parse_stat((entry / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
            if pgrp == pgid:
                pids.append(pid)
    return sorted(pids)


def machine_cpu(proc: Path = Path("/proc")) -> float:
    """CPU seconds all cores have spent busy since boot (everything but idle and iowait)."""
    fields = (proc / "stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICKS


class CpuMeter:
    """Measures CPU used by named process groups (and the whole machine, as `machine`) between
    `start()` and `stop()`."""

    def __init__(self, groups: dict[str, int]):
        self.groups = groups
        self._t0 = 0.0
        self._cpu0: dict[int, float] = {}
        self._machine0 = 0.0

    def start(self) -> None:
        self._cpu0 = group_cpu(self.groups.values())
        self._machine0 = machine_cpu()
        self._t0 = time.monotonic()

    def stop(self) -> dict[str, dict[str, float]]:
        """Per group: CPU seconds used and the average share of one core, in percent."""
        cpu1 = group_cpu(self.groups.values())
        machine = machine_cpu() - self._machine0
        wall = max(time.monotonic() - self._t0, 1e-9)
        used = {name: max(0.0, cpu1.get(pgid, 0.0) - self._cpu0.get(pgid, 0.0))
                for name, pgid in self.groups.items()}
        used["machine"] = machine
        return {name: {"cpu_s": round(u, 3), "wall_s": round(wall, 3),
                       "core_pct": round(100.0 * u / wall, 2)} for name, u in used.items()}


def add_start_and_quiet_args(p, quiet_timeout: float = 1800.0) -> None:
    """The flags every benchmark that starts servers and waits for a quiet machine shares."""
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--quiet-below", type=float, default=30.0,
                   help="before each measurement, wait until the machine uses at most this %% "
                        "of one core")
    p.add_argument("--quiet-timeout", type=float, default=quiet_timeout)


def wait_quiet(max_core_pct: float, timeout: float, window: float = 3.0) -> float:
    """Wait until the whole machine uses at most `max_core_pct` of one core over `window`
    seconds (others' jobs share these cores); return the seconds waited (timeout: give up)."""
    t0 = time.monotonic()
    while True:
        before = machine_cpu()
        time.sleep(window)
        pct = 100.0 * (machine_cpu() - before) / window
        waited = time.monotonic() - t0
        if pct <= max_core_pct or waited >= timeout:
            return waited


def measure_idle(groups: dict[str, int], seconds: float) -> dict[str, dict[str, float]]:
    meter = CpuMeter(groups)
    meter.start()
    time.sleep(seconds)
    return meter.stop()


def machine() -> dict[str, object]:
    """What the results were measured on (and how busy it was when they started)."""
    info: dict[str, object] = {"cpus": sorted(os.sched_getaffinity(0))}
    try:
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def stop_on_sigterm() -> None:
    """SIGTERM (and SIGINT, even where a shell ignores it for background jobs) unwind like
    Ctrl-C, so every configuration that is up gets stopped as a whole."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
