"""The CPU connector frees, when its worker asks, the blocks of a prefill whose end never reached
a controller (pdserve/kv/cpu_nixl.py, RELEASE_HELD): the request that asks is finished at once,
the next step's metadata names its legs, and the engine's side reports their requests as sent,
which makes the scheduler free their blocks. Fakes stand for vLLM's scheduler and NIXL worker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

from pdserve.kv import cpu_nixl
from pdserve.protocol import RELEASE_HELD


class FakeScheduler:
    """vLLM's NIXL scheduler side as far as these calls reach it."""

    def __init__(self):
        self.finished: list[str] = []

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return True, {"remote_request_id": request.request_id}

    def build_connector_meta(self, scheduler_output):
        return NixlConnectorMetadata()


class FakeWorker:
    """vLLM's NIXL worker on a prefill engine: the requests whose blocks are held for a decode
    (_reqs_to_send, by deadline) and those it tracks in a batch."""

    def __init__(self, held: list[str]):
        self._reqs_to_send = {r: 30.0 for r in held}
        self._reqs_to_process = set(held)
        self.done_sending: set[str] = set()  # as a decode's read-done notice would report

    def get_transfer_results(self):
        return KVConnectorTransferResults(finished_sending=set(self.done_sending),
                                          finished_recving=set())


def connector(held: list[str] = ()) -> cpu_nixl.PDCpuNixlConnector:
    c = object.__new__(cpu_nixl.PDCpuNixlConnector)  # no engine: both sides are faked
    c.connector_scheduler, c.connector_worker = FakeScheduler(), FakeWorker(list(held))
    c.kv_transfer_config = SimpleNamespace(kv_role="kv_both")
    c._connector_metadata, c._may_wait, c._landed = None, False, {}
    c._releases, c._released = set(), set()
    c._live, c._source, c._in_step_chosen, c._reads = set(), {}, {}, {}
    c._in_step_next, c._in_step_sent, c._scope = set(), set(), None
    c._notices = None
    return c


@pytest.fixture(autouse=True)
def no_reads(monkeypatch):
    """vLLM's start_load_kv posts the step's reads; a prefill engine has none."""
    monkeypatch.setattr(cpu_nixl.NixlPullConnector, "start_load_kv", lambda *a, **k: None)


def request(request_id: str, params: dict | None):
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params)


def step(c) -> KVConnectorTransferResults:
    """One engine step with the metadata the scheduler built for it."""
    c._connector_metadata = c.build_connector_meta(None)
    c.start_load_kv(SimpleNamespace(attn_metadata=None))
    return c.get_transfer_results(set())


def test_the_asking_request_holds_nothing_and_the_next_step_names_its_leg():
    c = connector()
    assert c.request_finished(request("leg-1-release", {RELEASE_HELD: ["leg-1"]}), [1]) == (
        False, None)
    assert c.request_finished_all_groups(request("leg-2-release", {RELEASE_HELD: ["leg-2", "leg-3"]}),
                                         ([1],)) == (False, None)
    assert c.connector_scheduler.finished == []  # never vLLM's: it would take it for a decode's
    assert getattr(c.build_connector_meta(None), cpu_nixl._RELEASE) == {"leg-1", "leg-2", "leg-3"}
    assert not hasattr(c.build_connector_meta(None), cpu_nixl._RELEASE)  # named once


def test_other_requests_finish_as_vllm_says():
    c = connector()
    assert c.request_finished(request("r-0a1b2c3d", {"do_remote_decode": True}), [1]) == (
        True, {"remote_request_id": "r-0a1b2c3d"})
    assert c.connector_scheduler.finished == ["r-0a1b2c3d"]


def test_only_the_named_legs_held_blocks_are_reported_sent_once():
    # The engine names a request by its leg's id, a dash and 8 characters of its own.
    c = connector(held=["cmpl-9-p1-0a1b2c3d", "cmpl-9-p1-x-0a1b2c3d", "cmpl-1-p1-77777777"])
    c.connector_worker.done_sending = {"cmpl-1-p1-77777777"}  # a decode read it meanwhile
    c.request_finished(request("cmpl-9-p1-release", {RELEASE_HELD: ["cmpl-9-p1"]}), [])
    assert step(c).finished_sending == {"cmpl-9-p1-0a1b2c3d", "cmpl-1-p1-77777777"}
    worker = c.connector_worker
    assert set(worker._reqs_to_send) == {"cmpl-9-p1-x-0a1b2c3d", "cmpl-1-p1-77777777"}
    assert "cmpl-9-p1-0a1b2c3d" not in worker._reqs_to_process  # its lease will not run out
    worker.done_sending = set()
    assert step(c).finished_sending == set()


def test_a_leg_not_held_is_nothing_to_free():
    # Still running when the worker aborted it (the abort freed it), or read already.
    c = connector(held=["other-0a1b2c3d"])
    c.request_finished(request("gone-release", {RELEASE_HELD: ["gone"]}), [])
    assert step(c).finished_sending == set()
    assert set(c.connector_worker._reqs_to_send) == {"other-0a1b2c3d"}


def test_a_request_named_as_the_engine_reported_it_is_freed():
    # A controller with no decode worker to carry a release names the prefill's request by
    # its remote_request_id, the engine's own id.
    c = connector(held=["cmpl-9-p1-0a1b2c3d", "cmpl-9-p1-11111111"])
    c.request_finished(request("cmpl-9-r2-release", {RELEASE_HELD: ["cmpl-9-p1-0a1b2c3d"]}), [])
    assert step(c).finished_sending == {"cmpl-9-p1-0a1b2c3d"}
    assert set(c.connector_worker._reqs_to_send) == {"cmpl-9-p1-11111111"}
