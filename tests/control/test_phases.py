"""The KV handoff split into phases (controller/phases.py): clocks that can be compared."""

from __future__ import annotations

import pytest

from pdserve.controller.phases import PHASES, HandoffClock, handoff_phases

# Controller clock: prefill result in at 100.0, decode leg sent at 100.002, first token in at
# 100.050. Worker clock (another host: an offset of 5,000 s): Generate in at 5000.010, engine
# queued .011, read asked .013, read done .030, first token .040, output sent .041.
TIMINGS = [5000.010, 5000.011, 5000.035, 5000.040, 5000.041]


def test_phases_add_up_to_the_handoff_the_controller_saw():
    got = handoff_phases(100.0, 100.002, 100.050, TIMINGS, (5000.013, 5000.030))
    assert set(got) == set(PHASES)
    assert got["controller"] == pytest.approx(0.002)
    assert got["transit"] == pytest.approx(0.048 - 0.031)  # round trip less the worker's time
    assert got["worker_in"] == pytest.approx(0.001)
    assert got["worker_out"] == pytest.approx(0.001)
    assert got["schedule"] == pytest.approx(0.002)
    assert got["kv_read"] == pytest.approx(0.017)
    assert got["first_step"] == pytest.approx(0.010)
    assert sum(got.values()) == pytest.approx(0.050)


def test_without_the_connectors_read_times_the_read_is_part_of_the_first_step():
    got = handoff_phases(100.0, 100.002, 100.050, TIMINGS)
    assert "kv_read" not in got
    assert got["schedule"] == pytest.approx(0.024) and got["first_step"] == pytest.approx(0.005)
    assert sum(got.values()) == pytest.approx(0.050)


def test_a_clock_without_the_workers_report_has_no_phases():
    clock = HandoffClock(prefill_out=1.0, decode_sent=1.1, first_out=1.2)
    assert clock.phases(None) is None
    clock.timings = TIMINGS
    assert clock.phases(None) is not None
