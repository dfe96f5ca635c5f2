"""The CPU connector's KV reads (pdserve/kv/cpu_nixl.py), with a fake NIXL worker and a fake
clock: a step's reads go out before its forward, a step that ran no model reports a read that
lands within its wait, and a decode engine reads a prompt's KV inside the step that computes the
prompt's next position when no other stream would wait long for it."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.outputs import KVConnectorOutput

from pdserve.kv import cpu_nixl
from pdserve.protocol import KV_READ_STATS


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


class FakeWorker:
    """vLLM's NIXL worker as far as the connector reads it: a read posted is a handle whose
    states FakeNixl scripts; a request whose peer's handshake is under way waits in
    _ready_requests until `handshake_done`."""

    def __init__(self, nixl: FakeNixl, transfers: dict[str, list[int]] | None = None):
        self.nixl_wrapper = nixl
        self._recving_transfers = {} if transfers is None else transfers
        self._recv_failures: set[str] = set()
        self._failed_recv_reqs: queue.Queue = queue.Queue()
        self._ready_requests: queue.Queue = queue.Queue()
        self.handles = {}  # request -> the handle a read of it gets
        self.posted: list[str] = []

    def _read_blocks_for_req(self, req_id, meta):
        self.posted.append(req_id)
        self._recving_transfers[req_id] = [self.handles[req_id]]

    def start_load_kv(self, metadata):  # vLLM's: post every read in the metadata
        for req_id, meta in metadata.reqs_to_recv.items():
            self._read_blocks_for_req(req_id, meta)


def connector(transfers: dict[str, list[int]], nixl: FakeNixl):
    c = object.__new__(cpu_nixl.PDCpuNixlConnector)  # no engine: only the worker side is tested
    c.connector_worker = FakeWorker(nixl, transfers)
    c._connector_metadata, c._landed, c._post_early = None, {}, True
    c._quick, c._notices = {}, None
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


# ---- a decode engine's agent has no progress thread: its reads move at each layer ---------

@pytest.mark.parametrize("drives", [True, False])
def test_reads_in_flight_move_at_each_attention_layer_without_a_progress_thread(drives):
    nixl = FakeNixl({1: ["PROC", "PROC", "DONE"], 2: ["DONE"]})
    c = connector({"a": [1], "b": [2]}, nixl)
    c._drives_reads = drives
    for layer in range(3):
        c.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
    assert nixl.checks == (6 if drives else 0)  # each read checked at each layer
    assert nixl.states[1] == (["DONE"] if drives else ["PROC", "PROC", "DONE"])


# ---- an idle decode engine reads inside the step that computes the next position -----------

def test_an_in_step_read_is_waited_for_and_its_landing_reported(clock):
    c = connector({}, FakeNixl({7: ["PROC", "PROC", "DONE"]}))
    c.connector_worker.handles["r"] = 7
    c.connector_worker._read_blocks_for_req("r", None)
    c._land({"r"}, deadline=1.0)
    assert 0 < clock.now < 1.0
    assert c.build_connector_worker_meta().landed == {"r": clock.now}
    assert c.build_connector_worker_meta() is None  # reported once


def test_an_in_step_read_waits_out_its_peers_handshake_then_posts_it(clock):
    worker = FakeWorker(FakeNixl({7: ["DONE"]}))
    worker.handles["r"] = 7
    c = connector({}, worker.nixl_wrapper)
    c.connector_worker = worker

    def handshake_done(seconds):  # the handshake thread queues the request meanwhile
        clock.now += seconds
        if clock.now > 0.01 and not worker.posted:
            worker._ready_requests.put(("r", None))
    clock.sleep = handshake_done
    c._land({"r"}, deadline=1.0)
    assert worker.posted == ["r"] and 0.01 < clock.now < 0.02


@pytest.mark.parametrize("failure", ["at post", "handshake", "transfer"])
def test_a_failed_in_step_read_is_left_to_vllm_to_report(clock, failure):
    c = connector({}, FakeNixl({7: ["ERR"]}))
    worker = c.connector_worker
    if failure == "at post":
        worker._recv_failures.add("r")
    elif failure == "handshake":
        worker._failed_recv_reqs.put("r")
    else:
        worker._recving_transfers["r"] = [7]
    c._land({"r"}, deadline=1.0)
    assert clock.now == 0.0


def test_an_in_step_read_that_never_lands_stops_the_engine(clock):
    c = connector({"r": [7]}, FakeNixl({7: ["PROC"]}))
    with pytest.raises(cpu_nixl.InStepReadTimeout, match="'r'"):
        c._land({"r"}, deadline=0.5)
    assert clock.now >= 0.5


@pytest.mark.parametrize("on_cpu", [True, False])
def test_a_steps_reads_are_posted_before_it_prepares_its_inputs_on_a_cpu(clock, on_cpu):
    """vLLM posts an asynchronous read after the forward, done by then on a CPU: the read
    would move during the next step. Posted as the step begins, it moves during this one."""
    c = connector({}, FakeNixl({7: ["DONE"], 8: ["DONE"]}))
    c._post_early = on_cpu
    worker = c.connector_worker
    worker.handles.update(r=7, other=8)
    meta = NixlConnectorMetadata()
    meta.reqs_to_recv = {"r": "meta r", "other": "meta other"}
    setattr(meta, cpu_nixl._IN_STEP, {"r"})  # one in-step read, one asynchronous
    c.handle_preemptions(meta)
    if on_cpu:
        assert worker.posted == ["r", "other"] and meta.reqs_to_recv == {}
    else:  # a GPU's forward is only launched when vLLM posts the reads: left to it
        assert worker.posted == [] and list(meta.reqs_to_recv) == ["r", "other"]
    worker.start_load_kv(meta)  # vLLM's own call, after the forward
    assert worker.posted == ["r", "other"]  # each read posted once


def test_each_read_posted_as_the_step_begins_is_reported_landed_as_posted_or_not(clock):
    """What the scheduler learns of each peer: a read by cross-memory attach is copied inside
    the call that posts it; one over TCP waits for the holder to answer."""
    c = connector({}, FakeNixl({7: ["DONE"], 8: ["PROC", "DONE"], 9: ["ERR"]}))
    worker = c.connector_worker
    worker.handles.update(copied=7, moving=8, failed=9)
    meta = NixlConnectorMetadata()
    meta.reqs_to_recv = {"copied": "m", "moving": "m", "failed": "m", "handshaking": "m"}
    worker.start_load_kv = lambda m: [worker._read_blocks_for_req(r, None)
                                      for r in m.reqs_to_recv if r != "handshaking"]
    c.handle_preemptions(meta)
    assert c.build_connector_worker_meta().quick == {"copied": True, "moving": False,
                                                    "failed": False}
    assert c.build_connector_worker_meta() is None  # reported once



class Notices:
    """The connector's HeldNotices (kv/notices.py): what had happened each time it was told to
    send the notices due."""

    def __init__(self, c):
        self.c, self.sends = c, []

    def send(self):
        self.sends.append((list(self.c.connector_worker.posted), dict(self.c._quick),
                           set(self.c._landed)))


def test_notices_go_out_after_the_steps_reads_are_posted_and_checked_and_after_they_land(
        clock, monkeypatch):
    """So no read of the step follows a notice to its peer (which would make it wait for the
    peer to answer), and each notice of a read done goes out before the step computes."""
    monkeypatch.setattr(cpu_nixl.NixlPullConnector, "start_load_kv", lambda *a, **k: None)
    monkeypatch.setattr(cpu_nixl.NixlPullConnector, "get_transfer_results",
                        lambda self, finished: SimpleNamespace(finished_sending=set()))
    c = connector({}, FakeNixl({7: ["DONE"], 8: ["PROC", "DONE"]}))
    c._notices = notices = Notices(c)
    c._may_wait, c._released = False, set()
    worker = c.connector_worker
    worker.handles.update(copied=7, in_step=8)
    meta = NixlConnectorMetadata()
    meta.reqs_to_recv = {"copied": "m", "in_step": "m"}
    setattr(meta, cpu_nixl._IN_STEP, {"in_step"})
    c.handle_preemptions(meta)
    assert notices.sends == [(["copied", "in_step"], {"copied": True, "in_step": False}, set())]
    c._connector_metadata = meta
    c.start_load_kv(SimpleNamespace(attn_metadata={"layer.0": object()}))
    assert notices.sends[-1][2] == {"in_step"}  # after the in-step read landed
    c.get_transfer_results(set())
    assert len(notices.sends) == 3  # and at the step's end, for reads found done then


# ---- the scheduler side chooses which reads are in-step ------------------------------------

@pytest.fixture
def scheduler(monkeypatch):
    """The connector's scheduler side over a stand-in for vLLM's: every remote prefill is a read
    of `remote_num_tokens` tokens, asynchronous."""
    base = cpu_nixl.NixlPullConnector
    monkeypatch.setattr(base, "__init__", lambda self, *a: None)
    monkeypatch.setattr(base, "get_num_new_matched_tokens",
                        lambda self, req, n: (req.kv_transfer_params["remote_num_tokens"] - n,
                                              True))
    monkeypatch.setattr(base, "update_state_after_alloc",
                        lambda self, req, blocks, n: self.allocated.append(blocks))
    monkeypatch.setattr(base, "build_connector_meta", lambda self, out: NixlConnectorMetadata())
    monkeypatch.setattr(base, "update_connector_output", lambda self, out: None)
    monkeypatch.setattr(base, "request_finished", lambda self, req, blocks: (False, None))
    monkeypatch.setattr(cpu_nixl, "IN_STEP_READS", True)
    monkeypatch.setattr(cpu_nixl.current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(cpu_nixl, "copy_scope", lambda: HERE)
    c = cpu_nixl.PDCpuNixlConnector(None, KVConnectorRole.SCHEDULER,
                                    SimpleNamespace(kv_cache_groups=["one"]))
    c.connector_scheduler = SimpleNamespace(use_host_buffer=False, block_size=BLOCK)
    c.allocated = []  # the blocks vLLM's NIXL scheduler was given, per allocation
    return c


BLOCK = 128
HERE = "this engine's copy scope"


def request(req_id: str, engine: str = "P", context: int = 300, extra: int = 1,
            asks_stats: bool = True, scope: str | None = HERE):
    """A decode leg: the prefill's context, plus `extra` tokens (1: the prefill's token), from a
    prefill engine in copy scope `scope`; it asks for the read's stats as a pdserve worker's
    does (`asks_stats`)."""
    params = {"do_remote_prefill": True, "remote_num_tokens": context, "remote_engine_id": engine}
    if scope is not None:
        params[cpu_nixl._COPY_SCOPE] = scope
    if asks_stats:
        params[KV_READ_STATS] = True
    return SimpleNamespace(request_id=req_id, num_tokens=context + extra,
                           kv_transfer_params=params)


def blocks(hashed: list[bool]) -> KVCacheBlocks:
    out = [KVCacheBlock(block_id=10 + i) for i in range(len(hashed))]
    for b, h in zip(out, hashed):
        if h:
            b._block_hash = b"hash of block %d" % b.block_id
    return KVCacheBlocks((out,))


def schedule(c, req, hits: int = 0, hashed: list[bool] | None = None) -> bool:
    """One step that schedules `req` (its first `hits` blocks in the engine's prefix cache, its
    blocks hashed as `hashed` says after the allocation); whether its read is asynchronous."""
    count, is_async = c.get_num_new_matched_tokens(req, hits * BLOCK)
    c.update_state_after_alloc(req, blocks(hashed or [False] * 3), count)
    return is_async


def test_an_idle_engine_reads_in_step_from_a_peer_it_has_read_from(scheduler):
    c = scheduler
    assert schedule(c, request("first"))  # a new peer: the handshake is not done yet
    assert getattr(c.build_connector_meta(None), cpu_nixl._IN_STEP, None) is None
    c.update_connector_output(KVConnectorOutput(finished_recving={"first"}))
    c.request_finished(request("first"), [])

    assert not schedule(c, request("second"))
    meta = c.build_connector_meta(None)
    assert getattr(meta, cpu_nixl._IN_STEP) == {"second"}
    out = KVConnectorOutput(finished_recving={"second"},
                            kv_connector_worker_meta=cpu_nixl.ReadsLanded({"second": 12.5}))
    c.update_connector_output(out)
    assert out.finished_recving == set()  # the scheduler would take it for a waiting request
    _, params = c.request_finished(request("second"), [])
    assert params[KV_READ_STATS][3:] == [12.5, 1.0]  # landed when the worker saw it


def test_a_read_is_reported_only_to_a_request_that_asked(scheduler):
    """A decode request from any other server loading the connector (vllm serve behind a proxy)
    ends with the kv_transfer_params vLLM's NIXL gives it: that server hands them to its
    client."""
    c = scheduler
    for name, asks in (("pdserve's", True), ("another server's", False)):
        schedule(c, request(name, asks_stats=asks))
        c.update_connector_output(KVConnectorOutput(finished_recving={name}))
    _, ours = c.request_finished(request("pdserve's"), [])
    _, theirs = c.request_finished(request("another server's", asks_stats=False), [])
    assert ours[KV_READ_STATS][:2] == [0, 300]  # nothing cached here, the prompt read
    assert theirs is None  # as vLLM's NixlConnector ends a decode request
    assert c._reads == {}  # neither is remembered past its end


def test_an_in_step_read_reads_the_blocks_vllm_cached_as_it_allocated_them(scheduler):
    c = scheduler
    schedule(c, request("first"))
    c.update_connector_output(KVConnectorOutput(finished_recving={"first"}))
    c.request_finished(request("first"), [])
    # A 300-token context, its first block a prefix-cache hit. A synchronous load's blocks are
    # cached (hashed) as they are allocated: the full second one too, though it is still to read.
    assert not schedule(c, request("second"), hits=1, hashed=[True, True, False])
    assert c.allocated[-1].get_unhashed_block_ids_all_groups() == [[11, 12]]
    c.request_finished(request("second"), [])
    # A 256-token context fills two blocks; the prefill's token, computed in the step, is in a
    # third one, which the read does not fill.
    assert not schedule(c, request("full", context=2 * BLOCK), hashed=[True, True, False])
    assert c.allocated[-1].get_unhashed_block_ids_all_groups() == [[10, 11]]
    assert [len(g) for g in c.allocated[-1].blocks] == [2]
    # An asynchronous read's blocks are cached once it is done: they are passed on as they are.
    c.request_finished(request("full"), [])
    schedule(c, request("busy"))
    assert schedule(c, request("async"), hits=1, hashed=[True, False, False])
    assert c.allocated[-1].get_unhashed_block_ids_all_groups() == [[11, 12]]


def test_reads_stay_in_steps_of_their_own_when_the_engine_is_busy_or_the_peer_unknown(scheduler):
    c = scheduler
    schedule(c, request("first"))
    c.update_connector_output(KVConnectorOutput(finished_recving={"first"}))
    # "first" still holds blocks (it is streaming): a read in its step would pause it.
    assert schedule(c, request("busy"))
    c.update_connector_output(KVConnectorOutput(finished_recving={"busy"}))
    assert c.build_connector_meta(None) is not None
    for r in ("first", "busy"):
        c.request_finished(request(r), [])
    # A peer whose read failed is not known to be reachable.
    assert schedule(c, request("to Q", engine="Q"))
    c.update_connector_output(KVConnectorOutput(finished_recving={"to Q"},
                                                failed_recving={"to Q"}))
    c.request_finished(request("to Q", engine="Q"), [])
    assert schedule(c, request("again to Q", engine="Q"))


def test_a_busy_engine_reads_in_step_only_from_a_peer_one_of_whose_reads_landed_as_posted(
        scheduler):
    c = scheduler
    schedule(c, request("streaming"))  # P's first read; it goes on streaming here
    c.update_connector_output(KVConnectorOutput(finished_recving={"streaming"}))
    assert schedule(c, request("busy"))  # nothing known of how P's reads land yet
    c.build_connector_meta(None)
    landed_as_posted = cpu_nixl.ReadsLanded({}, {"busy": True})
    c.update_connector_output(KVConnectorOutput(finished_recving={"busy"},
                                                kv_connector_worker_meta=landed_as_posted))
    assert not schedule(c, request("next"))  # in the step, beside the other streams
    assert getattr(c.build_connector_meta(None), cpu_nixl._IN_STEP) == {"next"}
    # A later read of P's that did not land as posted (P late to answer its flush, kv/notices.py):
    # P's reads stay in the step.
    c.update_connector_output(KVConnectorOutput(
        finished_recving={"next"},
        kv_connector_worker_meta=cpu_nixl.ReadsLanded({"next": 3.0}, {"next": False})))
    assert not schedule(c, request("after it"))
    c.build_connector_meta(None)
    # A peer none of whose reads landed as posted (over TCP) keeps to steps of its own.
    schedule(c, request("first from Q", engine="Q"))
    c.update_connector_output(KVConnectorOutput(
        finished_recving={"first from Q"},
        kv_connector_worker_meta=cpu_nixl.ReadsLanded({}, {"first from Q": False})))
    assert schedule(c, request("next from Q", engine="Q"))
    # The same engine emptied: an idle engine reads in step from any peer it knows.
    for r in ("streaming", "busy", "next", "after it", "first from Q", "next from Q"):
        c.request_finished(request(r, engine="Q" if "Q" in r else "P"), [])
    assert not schedule(c, request("alone", engine="Q"))


@pytest.mark.parametrize("scope", ["another host or namespace", None])
def test_a_busy_engine_reads_in_step_from_no_peer_outside_its_copy_scope(scheduler, scope):
    """A read over TCP seems to land as posted when the reader is descheduled between posting and
    checking it: from a peer outside the reader's copy scope (None: its UCX may not use cma),
    that is no sign its reads are copies."""
    c = scheduler
    schedule(c, request("streaming", scope=scope))
    c.update_connector_output(KVConnectorOutput(finished_recving={"streaming"}))
    for name in ("busy", "next"):
        assert schedule(c, request(name, scope=scope))  # in a step of its own
        c.build_connector_meta(None)
        c.update_connector_output(KVConnectorOutput(
            finished_recving={name},
            kv_connector_worker_meta=cpu_nixl.ReadsLanded({}, {name: True})))
    for r in ("streaming", "busy", "next"):
        c.request_finished(request(r, scope=scope), [])
    assert not schedule(c, request("alone", scope=scope))  # idle: in step from any known peer


@pytest.mark.parametrize("scope", [HERE, None])
def test_a_prefill_hands_its_decode_its_copy_scope(scheduler, monkeypatch, scope):
    c = scheduler
    c._scope = scope
    held = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_block_ids": [[1, 2]]}
    monkeypatch.setattr(cpu_nixl.NixlPullConnector, "request_finished",
                        lambda self, req, blocks: (True, dict(held)))
    prefill = SimpleNamespace(request_id="leg", kv_transfer_params={"do_remote_decode": True})
    delay, params = c.request_finished(prefill, [1, 2])
    assert delay and params == ({**held, cpu_nixl._COPY_SCOPE: scope} if scope else held)


def test_a_whole_prompt_read_in_step_leaves_its_last_position_to_the_step(scheduler):
    c = scheduler
    schedule(c, request("first"))
    c.update_connector_output(KVConnectorOutput(finished_recving={"first"}))
    c.request_finished(request("first"), [])
    # The same context (the prefill's token forced at the next one): the prefill holds the
    # whole prompt, and the step recomputes its last position.
    forced = request("forced", extra=0)
    assert c.get_num_new_matched_tokens(forced, BLOCK) == (300 - 1 - BLOCK, False)
    c.update_state_after_alloc(forced, blocks([True, False, False]), 300 - 1 - BLOCK)
    assert c.allocated[-1].get_unhashed_block_ids_all_groups() == [[11, 12]]
    c.request_finished(forced, [])
    # Two blocks and one token: the last position is alone in the third block, which is read
    # all the same. vLLM's reader pairs the blocks it is given with the prefill's last ones:
    # given two, it would fill them with the prefill's second and third.
    edge = request("edge", context=2 * BLOCK + 1, extra=0)
    assert c.get_num_new_matched_tokens(edge, 0) == (2 * BLOCK, False)
    c.update_state_after_alloc(edge, blocks([True, True, False]), 2 * BLOCK)
    assert c.allocated[-1].get_unhashed_block_ids_all_groups() == [[10, 11, 12]]


def test_other_reads_finishing_in_the_same_step_still_reach_the_scheduler(scheduler):
    c = scheduler
    schedule(c, request("first"))
    c.update_connector_output(KVConnectorOutput(finished_recving={"first"}))
    c.request_finished(request("first"), [])
    assert not schedule(c, request("in step"))
    assert schedule(c, request("new peer", engine="Q"))  # same step, another prefill engine
    c.build_connector_meta(None)
    out = KVConnectorOutput(finished_recving={"in step", "new peer"})
    c.update_connector_output(out)
    assert out.finished_recving == {"new peer"}


def test_the_prefill_engines_read_from_are_remembered_up_to_a_bound(scheduler, monkeypatch):
    monkeypatch.setattr(cpu_nixl, "_MAX_PEERS", 2)
    c = scheduler
    for engine in ("P", "Q", "P", "R"):  # Q is the one read from least recently
        schedule(c, request(engine, engine=engine))
        c.update_connector_output(KVConnectorOutput(finished_recving={engine}))
        c.request_finished(request(engine, engine=engine), [])
    assert schedule(c, request("to Q", engine="Q"))
    c.update_connector_output(KVConnectorOutput(finished_recving={"to Q"}))
    c.request_finished(request("to Q", engine="Q"), [])
    assert not schedule(c, request("to R", engine="R"))
