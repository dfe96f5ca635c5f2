"""The CPU connector's wait for KV reads in flight (pdserve/kv/cpu_nixl.py), with a fake NIXL
worker and a fake clock: a step that ran no model reports a read that lands within the wait."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.kv import cpu_nixl


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class FakeNixl:
    """check_xfer_state answers from a script of states per handle, its last one repeating."""

    def __init__(self, states: dict[int, list[str]]):
        self.states = states
        self.checks = 0

    def check_xfer_state(self, handle: int) -> str:
        self.checks += 1
        script = self.states[handle]
        state = script.pop(0) if len(script) > 1 else script[0]
        if state == "RAISE":
            raise RuntimeError("transfer failed")
        return state


def connector(transfers: dict[str, list[int]], nixl: FakeNixl):
    c = object.__new__(cpu_nixl.PDCpuNixlConnector)  # no engine: only the wait is tested
    c.connector_worker = SimpleNamespace(_recving_transfers=transfers, nixl_wrapper=nixl)
    return c


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(cpu_nixl, "time", fake)
    return fake


def test_waits_until_every_read_has_landed(clock):
    nixl = FakeNixl({1: ["PROC", "PROC", "DONE"], 2: ["PROC", "DONE"]})
    connector({"a": [1], "b": [2]}, nixl)._until_reads_land(deadline=1e-3)
    assert 0 < clock.now < 1e-3
    assert nixl.states[1] == ["DONE"] and nixl.states[2] == ["DONE"]


def test_gives_up_at_the_deadline(clock):
    nixl = FakeNixl({1: ["PROC"]})
    connector({"a": [1]}, nixl)._until_reads_land(deadline=1e-3)
    assert 1e-3 <= clock.now < 1e-3 + 2 * cpu_nixl._POLL_S


@pytest.mark.parametrize("transfers, states", [({}, {}), ({"a": [1]}, {1: ["RAISE"]})])
def test_returns_at_once_with_nothing_in_flight_or_a_failed_read(clock, transfers, states):
    connector(transfers, FakeNixl(states))._until_reads_land(deadline=1e-3)
    assert clock.now == 0.0  # a failure is left to vLLM's own check to report


@pytest.mark.parametrize("attn_metadata, waits", [(None, True), ({"layer.0": object()}, False)])
def test_only_a_step_without_a_model_waits(monkeypatch, attn_metadata, waits):
    monkeypatch.setattr(cpu_nixl.NixlPullConnector, "start_load_kv", lambda *a, **k: None)
    c = connector({}, FakeNixl({}))
    c._may_wait = True  # a CPU engine with the wait on
    c.start_load_kv(SimpleNamespace(attn_metadata=attn_metadata))
    assert c._wait_for_reads is waits
