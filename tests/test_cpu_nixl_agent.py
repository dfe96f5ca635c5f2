"""How the CPU connector builds a worker's NIXL agent (pdserve/kv/cpu_nixl.py) and the engine's
UCX settings (pdserve/worker/engine.py): a decode engine's agent has no progress thread, a
prefill engine's has one that sleeps between polls, and a read still lands with no thread when
its reader checks it, as a decode engine does."""

from __future__ import annotations

import os
import sys
import time
import types

import numpy as np
import pytest
from procs import loopback_bytes
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

from pdserve.bench.nixl_read import (BLOCK_BYTES, LAYERS, NOTICE_WAYS, PDSERVE_WAYS, PROMPTS,
                                     STALL_S, TWO_HOSTS, Read, measure, nixl_agent, notice_table,
                                     noticed, stall_table)
from pdserve.kv import cpu_nixl
from pdserve.worker.engine import EngineSettings, Role, engine_env


@pytest.mark.parametrize("kv_role, thread", [("kv_consumer", False), ("kv_producer", True),
                                             ("kv_both", True)])
def test_only_a_decode_only_engine_goes_without_a_progress_thread(kv_role, thread):
    assert cpu_nixl.has_progress_thread(kv_role) is thread


def test_the_agent_built_in_the_block_gets_the_thread_setting_and_no_other(monkeypatch):
    """The hook replaces NIXL's agent constructor inside the block only."""
    built = []
    api = types.ModuleType("fake_nixl_api")
    api.nixlBind = types.SimpleNamespace(nixlAgent=lambda name, config: built.append(config))
    monkeypatch.setitem(sys.modules, api.__name__, api)
    wrapper = type("Wrapper", (), {"__module__": api.__name__})  # as NIXL's class names its module
    monkeypatch.setattr(base_worker, "NixlWrapper", wrapper)
    original = api.nixlBind.nixlAgent
    for thread in (False, True):
        with cpu_nixl.cpu_agent(progress_thread=thread):
            api.nixlBind.nixlAgent("agent", config := types.SimpleNamespace(pthrDelay=0,
                                                                            useProgThread=True))
        assert config.useProgThread is thread
        assert config.pthrDelay == cpu_nixl.PROGRESS_DELAY_US
        assert api.nixlBind.nixlAgent is original
    assert len(built) == 2


def test_a_cpu_engine_reads_over_cma_then_tcp_unless_told(monkeypatch):
    s = EngineSettings(role=Role.DECODE)
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert engine_env(s, cpu=True)["UCX_TLS"] == "cma,tcp"
    assert "UCX_TLS" not in engine_env(s, cpu=False)  # on GPUs UCX chooses, RDMA included
    monkeypatch.setenv("UCX_TLS", "tcp")
    assert "UCX_TLS" not in engine_env(s, cpu=True)


def test_a_cpu_engine_sends_a_read_in_32_kb_messages_unless_told(monkeypatch):
    s = EngineSettings(role=Role.PREFILL)
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    assert engine_env(s, cpu=True)["UCX_TCP_TX_SEG_SIZE"] == "32k"
    assert "UCX_TCP_TX_SEG_SIZE" not in engine_env(s, cpu=False)
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "8k")  # the user's own, which the engine inherits
    assert "UCX_TCP_TX_SEG_SIZE" not in engine_env(s, cpu=True)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_read_lands_without_a_progress_thread_when_its_reader_checks_it(monkeypatch):
    """Real NIXL over loopback TCP, both agents in this process: the prefill side's agent with
    its thread, the decode side's without one, reading 1 MB in four blocks."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    holder = nixl_agent("holder", progress_thread=True)  # and UCX's first-agent threads
    before = _threads()
    threaded = nixl_agent("threaded", progress_thread=True)
    with_thread = _threads() - before
    reader = nixl_agent("reader", progress_thread=False)
    assert _threads() - before - with_thread == with_thread - 1  # all but the progress thread
    del threaded
    size, blocks = 1 << 20, 4
    src = np.arange(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    holder.register_memory([(src.ctypes.data, size, 0, "")], "DRAM")
    reader.register_memory([(dst.ctypes.data, size, 0, "")], "DRAM")
    peer = reader.add_remote_agent(holder.get_agent_metadata())
    step = size // blocks
    local = reader.get_xfer_descs([(dst.ctypes.data + i * step, step, 0) for i in range(blocks)],
                                  "DRAM")
    remote = reader.get_xfer_descs([(src.ctypes.data + i * step, step, 0) for i in range(blocks)],
                                   "DRAM")
    handle = reader.initialize_xfer("READ", local, remote, peer)
    assert reader.transfer(handle) in ("PROC", "DONE")
    deadline = time.monotonic() + 10
    while (state := reader.check_xfer_state(handle)) == "PROC" and time.monotonic() < deadline:
        time.sleep(50e-6)
    assert state == "DONE"
    assert np.array_equal(dst, src)
    reader.release_xfer_handle(handle)


@pytest.mark.parametrize("way", PDSERVE_WAYS, ids=lambda w: w.tls)
def test_the_read_benchmark_times_each_size_over_tcp_or_cma(way):
    """Two processes on one host, as two engines: over TCP the blocks cross loopback; over cma
    the reader copies them from the holder's memory, and loopback carries only the handshake
    and the notifications (the bytes that would have crossed TCP are counted machine-wide)."""
    before = loopback_bytes()
    took = measure(way, reads=2)
    crossed = loopback_bytes() - before
    assert sorted(took) == sorted(PROMPTS)
    assert all(len(t) == 2 and all(r.seconds > 0 and r.checks >= 1 for r in t)
               for t in took.values())
    read = 2 * sum(PROMPTS.values()) * LAYERS * BLOCK_BYTES  # 2 reads of every size
    if way.tls == TWO_HOSTS:
        assert crossed >= read, (crossed, read)
    else:
        assert crossed < read // 10, (crossed, read)


def test_a_busy_reader_checks_once_per_layer_until_the_read_is_in():
    layer = 0.002
    took = measure(PDSERVE_WAYS[0], reads=2, layer_s=layer)
    assert sorted(took) == sorted(PROMPTS)
    for reads in took.values():
        for r in reads:  # each check came after a whole layer's compute
            assert r.checks >= 1 and r.seconds >= r.checks * layer
            assert 0 < r.checking < r.seconds


def test_the_read_benchmark_counts_the_stalled_reads_and_the_longest():
    reads = [Read(0.002, 1, 0.001), Read(STALL_S + 0.016, 3, 0.001), Read(0.004, 1, 0.001)]
    rows = list(stall_table({"one way": {t: reads for t in PROMPTS}}))
    assert rows[0] == "| prompt tokens | one way |"
    assert rows[2:] == [f"| {t} | 1 (31.0) |" for t in PROMPTS]


@pytest.mark.parametrize("way", [w for w in NOTICE_WAYS if w.held or not w.notice],
                         ids=lambda w: w.name)
def test_a_read_over_cma_lands_as_it_is_posted_when_no_notice_waits_for_its_flush(way):
    """Two processes, the reader copying over cma: UCX flushes a read's endpoint as part of it,
    and over TCP an endpoint that has sent a message (a read's notice to its holder) flushes only
    once the holder answers. With no notice before it, or through pdserve's HeldNotices (the
    notice before it followed by a flush), a read is done when the call that posts it returns,
    and its notice reaches the holder. (Right after vLLM's notice it is done then only if the
    holder has answered first, which is not asserted.)"""
    reads, got = noticed(way, reads=8)
    assert len(reads) == 8 and all(seconds > 0 for _, seconds in reads)
    assert all(posted for posted, _ in reads)
    assert got == (8 + 3 if way.notice else 0)  # the 3 before them set up the connection


def test_the_notice_table_counts_the_reads_landed_as_posted():
    rows = list(notice_table({"one way": [(True, 0.001), (False, 0.004), (True, 0.002)]}))
    assert rows[2] == "| one way | 2 of 3 | 2.00 (3.60) | 4.00 |"
