"""What procfs reads of processes, against what the kernel reports to the process itself."""

from __future__ import annotations

import os
import time

from pdserve import procfs


def test_cpu_seconds_of_this_process_are_the_cpu_time_it_reports_itself():
    before, own = procfs.cpu_seconds([os.getpid()]), os.times()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # compute
        pass
    after, own_after = procfs.cpu_seconds([os.getpid()]), os.times()
    used = (own_after.user + own_after.system) - (own.user + own.system)
    tick = 1 / procfs.TICKS_PER_S
    assert used > 0.25 and abs((after - before) - used) <= 2 * tick  # ticks: 0.3 may read 0.2999
    # A process that is gone counts nothing, and does not hide the others.
    assert procfs.cpu_seconds([os.getpid(), 2 ** 22 + 1]) >= after
    assert procfs.cpu_seconds([2 ** 22 + 1]) == 0.0
