"""Stop signals while a worker's engine starts (pdserve/worker/main.py `StartSignals`): the
first ends the start, and only a second SIGTERM or SIGINT hurries the stop, as after the start
(pdserve serve's SIGUSR1 is never a second)."""

from __future__ import annotations

import signal

import pytest

from pdserve.worker.main import DRAIN_SIGNAL, StartSignals, StoppedDuringStart


def deliver(s: StartSignals, *signals: int) -> None:
    for sig in signals:
        try:
            s._on_signal(sig, None)
        except StoppedDuringStart:
            assert sig == s.signals[0] and len(s.signals) == 1  # the first, and only it


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, DRAIN_SIGNAL])
def test_the_first_stop_signal_ends_the_start(sig):
    s = StartSignals()
    with pytest.raises(StoppedDuringStart, match=signal.Signals(sig).name):
        s._on_signal(sig, None)
    assert not s.again


@pytest.mark.parametrize("signals, again", [
    ((signal.SIGTERM, signal.SIGTERM), True),  # Ctrl-C twice, or kill twice
    ((signal.SIGINT, signal.SIGTERM), True),
    ((signal.SIGTERM, DRAIN_SIGNAL), False),  # systemd's stop, then serve's
    ((DRAIN_SIGNAL, signal.SIGTERM), False),  # the other order
    ((DRAIN_SIGNAL, DRAIN_SIGNAL, signal.SIGINT), False),
    ((DRAIN_SIGNAL, signal.SIGTERM, signal.SIGINT), True),
])
def test_only_a_second_sigterm_or_sigint_hurries_the_stop(signals, again):
    s = StartSignals()
    deliver(s, *signals)
    assert s.again is again
