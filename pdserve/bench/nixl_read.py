"""Figures for the KV read itself (kv/cpu_nixl.py, worker/engine.py): NIXL over UCX's TCP
transport on loopback, one process holding the blocks (its agent with a progress thread, as a
prefill engine's) and one reading them as a decode engine waits for an in-step read (checking
every 50 us), each on a core of its own. Over TCP, four ways: the reader's agent with and
without a progress thread, the holder sending the blocks back in UCX's default 8 KB messages and
in pdserve's 32 KB ones (UCX_TCP_TX_SEG_SIZE), as engines on two hosts read. And as engines on one
host read: cross-memory attach (UCX_TLS=cma,tcp), the reader copying the blocks itself.

`.venv/bin/python -m pdserve.bench.nixl_read` (~1-2 min; two cores). The sizes are the bench
preset's reads: 4 layers of 128 KB blocks of 128 tokens, one contiguous run per layer.

`--notices`: what vLLM's notice that a read is done (a message to the holder) does to the read
after it, over cma: UCX flushes a read's endpoint, and over its TCP lane an endpoint that has
sent a message flushes only once the peer answers. Reads posted without a notice, with one as
vLLM posts them, and through pdserve's HeldNotices (kv/notices.py: the notice sent once the read
is done, then a one-byte read without one, whose flush ends before the next read): how many
landed as they were posted (done at the first check) and how long each took.

`--busy-layer-ms MS`: the reader as a busy decode engine without a progress thread moves its
reads, computing MS between checks (one attention layer of a forward) and checking once at each
(the connector's `wait_for_layer_load`): how many such points a read needs, and how long its
checks take, which is the data being taken in (the read's CPU, paid inside the forward); over
TCP and over cma, pdserve's two ways.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.kv.notices import HeldNotices

PROMPTS = {100: 1, 300: 3, 1000: 8, 2000: 16}  # prompt tokens -> 128-token blocks
LAYERS, BLOCK_BYTES = 4, 128 * 1024
SPAN = 2 * LAYERS * BLOCK_BYTES * max(PROMPTS.values())  # each side's memory: runs apart (_runs)
GAP_S = 0.01  # between reads, as between handoffs
TINY_READ = 4 * 64 * 1024  # bytes: a tiny-preset read (--notices)
STALL_S = 0.015  # a read this long is stalled: 3-30 times its median at these sizes
ONE_HOST, TWO_HOSTS = "cma,tcp", "tcp"  # UCX_TLS: pdserve's on a CPU host, as each peer sees it


@dataclass(frozen=True)
class Way:
    name: str
    thread: bool  # the reader's agent has a progress thread
    seg: str  # UCX_TCP_TX_SEG_SIZE
    tls: str = TWO_HOSTS


WAYS = [
    Way("tcp, thread, 8 KB (before)", True, "8k"),
    Way("tcp, no thread, 8 KB", False, "8k"),
    Way("tcp, thread, 32 KB", True, "32k"),
    Way("tcp, no thread, 32 KB (pdserve, two hosts)", False, "32k"),
    Way("cma, no thread (pdserve, one host)", False, "32k", ONE_HOST),
]
PDSERVE_WAYS = WAYS[-2:]


def nixl_agent(name: str, progress_thread: bool) -> Any:
    """A NIXL agent over UCX, built as the CPU connector builds an engine's."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    from pdserve.kv.cpu_nixl import cpu_agent

    with cpu_agent(progress_thread):  # vLLM's NIXL worker asks for 4 UCX threads
        return base_worker.NixlWrapper(name, base_worker.nixl_agent_config(num_threads=4))


def _enter(core: int, way: Way) -> None:
    """UCX reads its settings as its first agent starts: set them first, in this process."""
    os.environ.update(UCX_TLS=way.tls, UCX_NET_DEVICES="lo", UCX_TCP_TX_SEG_SIZE=way.seg)
    if core in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {core})


def _hold(conn: Connection, core: int, way: Way) -> None:
    _enter(core, way)
    agent = nixl_agent("holder", progress_thread=True)
    blocks: np.ndarray = np.ones(SPAN, dtype=np.uint8)
    agent.register_memory([(blocks.ctypes.data, SPAN, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), blocks.ctypes.data))
    conn.recv()  # until the reader is done
    conn.send(sum(len(n) for n in agent.get_new_notifs().values()))  # the notices it got


def _runs(base: int, total: int) -> list[tuple[int, int, int]]:
    """One descriptor per layer's run of blocks, the runs apart (as layers are)."""
    run = total // LAYERS
    return [(base + i * 2 * run, run, 0) for i in range(LAYERS)]


@dataclass
class Read:
    seconds: float
    checks: int  # the points at which it was checked (busy reader) or the checks (waiting)
    checking: float  # seconds inside the checks


def _move(agent: Any, handle: Any, layer_s: float | None) -> Read:
    """Post a read and see it in. Waiting for it (`layer_s` None), as a decode engine waits for
    an in-step read: a check every _POLL_S. Busy (`layer_s`), as a busy decode engine moves it:
    a layer's compute, then one check (the connector's wait_for_layer_load)."""
    from pdserve.kv.cpu_nixl import _POLL_S

    start, checks, checking = time.perf_counter(), 0, 0.0
    agent.transfer(handle)
    while True:
        if layer_s is not None:
            until = time.perf_counter() + layer_s
            while time.perf_counter() < until:  # the layer computes: the core is busy
                pass
        t = time.perf_counter()
        state = agent.check_xfer_state(handle)
        checks, checking = checks + 1, checking + time.perf_counter() - t
        if state != "PROC":
            break
        if layer_s is None:
            time.sleep(_POLL_S)
    if state != "DONE":
        raise RuntimeError(f"a read ended {state}")
    return Read(time.perf_counter() - start, checks, checking)


def _read(conn: Connection, core: int, way: Way, reads: int, layer_s: float | None) -> None:
    _enter(core, way)
    agent = nixl_agent("reader", progress_thread=way.thread)
    local: np.ndarray = np.zeros(SPAN, dtype=np.uint8)
    agent.register_memory([(local.ctypes.data, SPAN, 0, "")], "DRAM")
    metadata, remote_base = conn.recv()
    peer = agent.add_remote_agent(metadata)
    out = {}
    for tokens, blocks in PROMPTS.items():
        total = blocks * LAYERS * BLOCK_BYTES
        mine = agent.get_xfer_descs(_runs(local.ctypes.data, total), "DRAM")
        theirs = agent.get_xfer_descs(_runs(remote_base, total), "DRAM")
        took = []
        for i in range(reads + 3):  # the first reads set up the connection
            handle = agent.initialize_xfer("READ", mine, theirs, peer)
            took.append(_move(agent, handle, layer_s))
            agent.release_xfer_handle(handle)
            time.sleep(GAP_S)
        out[tokens] = took[3:]
    conn.send(out)


def measure(way: Way, reads: int, layer_s: float | None = None) -> dict[int, list[Read]]:
    """Each size's reads; `layer_s`: the reader as a busy engine with layers that long."""
    return _pair(way, _read, (way, reads, layer_s))


@dataclass(frozen=True)
class Notice:
    name: str
    notice: bool  # each read carries a notice to the holder, as vLLM's reads do
    held: bool  # through pdserve's HeldNotices, its flush done before the next read


NOTICE_WAYS = [Notice("no notice", False, False), Notice("vLLM's notice", True, False),
               Notice("pdserve's: the notice after the read, then a flush", True, True)]


def _read_noticed(conn: Connection, core: int, way: Notice, reads: int) -> None:
    """Reads of four 64 KB blocks over cma (the tiny preset's, whose posting is quick), made as
    vLLM's reader makes them; whether each landed as it was posted."""
    _enter(core, Way(way.name, False, "32k", ONE_HOST))
    agent = nixl_agent("reader", progress_thread=False)
    reader = HeldNotices(agent) if way.held else agent
    local: np.ndarray = np.zeros(SPAN, dtype=np.uint8)
    agent.register_memory([(local.ctypes.data, SPAN, 0, "")], "DRAM")
    metadata, remote_base = conn.recv()
    peer = agent.add_remote_agent(metadata)
    mine = reader.prep_xfer_dlist("NIXL_INIT_AGENT", _runs(local.ctypes.data, TINY_READ), "DRAM")
    theirs = reader.prep_xfer_dlist(peer, _runs(remote_base, TINY_READ), "DRAM")
    layers = list(range(LAYERS))
    out: list[tuple[bool, float]] = []
    for i in range(reads + 3):  # the first reads set up the connection
        notice = f"read-{i}".encode() if way.notice else b""
        handle = reader.make_prepped_xfer("READ", mine, layers, theirs, layers, notif_msg=notice)
        start = time.perf_counter()
        reader.transfer(handle)
        posted = reader.check_xfer_state(handle) == "DONE"
        while (state := reader.check_xfer_state(handle)) == "PROC":
            time.sleep(0)  # each check moves the read: the reader has no progress thread
        out.append((posted, time.perf_counter() - start))
        reader.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"a read ended {state}")
        if isinstance(reader, HeldNotices):
            reader.send()
            while reader.flushing:
                time.sleep(GAP_S / 100)
                reader.send()
        time.sleep(GAP_S)
    conn.send(out[3:])


def noticed(way: Notice, reads: int) -> tuple[list[tuple[bool, float]], int]:
    """Each read (whether it landed as it was posted, and its seconds), and the notices the
    holder got."""
    return _pair(Way(way.name, False, "32k", ONE_HOST), _read_noticed, (way, reads), True)


def notice_table(results: dict[str, list[tuple[bool, float]]]) -> Iterator[str]:
    yield "| reads | landed as posted | read p50 (p90), ms | longest (ms) |"
    yield "|---|---|---|---|"
    for name, reads in results.items():
        took = [t for _, t in reads]
        yield (f"| {name} | {sum(p for p, _ in reads)} of {len(reads)} | {_cells(took)} "
               f"| {max(took) * 1e3:.2f} |")


def _pair(way: Way, read: Any, args: tuple, notices: bool = False) -> Any:
    """A holder on core 0 and `read` on core 1 (each in a process of its own): its answer, and
    with `notices`, how many notices the holder got."""
    ctx = mp.get_context("spawn")
    hold_end, hold_here = ctx.Pipe()
    read_end, read_here = ctx.Pipe()
    holder = ctx.Process(target=_hold, args=(hold_end, 0, way), daemon=True)
    reader = ctx.Process(target=read, args=(read_end, 1, *args), daemon=True)
    holder.start()
    reader.start()
    try:
        read_here.send(hold_here.recv())
        answer = read_here.recv()
    finally:
        hold_here.send("done")  # the holder then tells how many notices it got
        got = hold_here.recv() if hold_here.poll(10) else None
        for p in (holder, reader):
            p.join(10)
            if p.is_alive():
                p.kill()
    return (answer, got) if notices else answer


def _cells(times: list[float]) -> str:
    ms = np.array(times) * 1e3
    return f"{np.median(ms):.2f} ({np.percentile(ms, 90):.2f})"


def table(results: dict[str, dict[int, list[Read]]]) -> Iterator[str]:
    yield "| prompt tokens | KB read | " + " | ".join(results) + " |"
    yield "|---" * (2 + len(results)) + "|"
    for tokens, blocks in PROMPTS.items():
        cells = " | ".join(_cells([r.seconds for r in by[tokens]]) for by in results.values())
        yield f"| {tokens} | {blocks * LAYERS * BLOCK_BYTES // 1024} | {cells} |"


def _stalls(reads: list[Read]) -> str:
    """The reads that took over STALL_S, and the longest (ms)."""
    over = sum(r.seconds > STALL_S for r in reads)
    return f"{over} ({max(r.seconds for r in reads) * 1e3:.1f})"


def stall_table(results: dict[str, dict[int, list[Read]]]) -> Iterator[str]:
    yield "| prompt tokens | " + " | ".join(results) + " |"
    yield "|---" * (1 + len(results)) + "|"
    for tokens in PROMPTS:
        yield f"| {tokens} | " + " | ".join(_stalls(by[tokens]) for by in results.values()) + " |"


def busy_table(results: dict[int, list[Read]]) -> Iterator[str]:
    yield ("| prompt tokens | KB read | read (ms) | layer points p50 / max | in its checks (ms) "
           f"| over {STALL_S * 1e3:g} ms (longest) |")
    yield "|---|---|---|---|---|---|"
    for tokens, blocks in PROMPTS.items():
        reads = results[tokens]
        points = [r.checks for r in reads]
        yield (f"| {tokens} | {blocks * LAYERS * BLOCK_BYTES // 1024} | "
               f"{_cells([r.seconds for r in reads])} | {np.median(points):.0f} / {max(points)} | "
               f"{_cells([r.checking for r in reads])} | {_stalls(reads)} |")


def _congestion_control() -> str:
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.nixl_read", description=__doc__)
    p.add_argument("--reads", type=int, default=60, help="reads per size and way")
    p.add_argument("--rounds", type=int, default=1, help="each way this many times, in turn")
    p.add_argument("--busy-layer-ms", type=float, default=None,
                   help="the reader as a busy engine (pdserve's way): MS of compute per layer")
    p.add_argument("--notices", action="store_true",
                   help="what a read's notice to the holder does to the read after it (cma)")
    args = p.parse_args(argv)
    # Over loopback TCP, BBR's paced sends came out of order and stalled reads (performance.md).
    print(f"TCP congestion control: {_congestion_control()}")
    for r in range(args.rounds):
        if args.notices:
            by_way = {way.name: noticed(way, args.reads)[0] for way in NOTICE_WAYS}
            print(f"\nround {r + 1}: reads of four 64 KB blocks over cma, {args.reads} each, "
                  f"{GAP_S * 1e3:g} ms apart\n")
            print("\n".join(notice_table(by_way)), flush=True)
            continue
        if args.busy_layer_ms is not None:
            for way in PDSERVE_WAYS:
                busy = measure(way, args.reads, args.busy_layer_ms / 1e3)
                print(f"\nround {r + 1}, {way.name}: a busy reader, {args.busy_layer_ms:g} ms "
                      f"per layer, p50 (p90), {args.reads} reads each\n")
                print("\n".join(busy_table(busy)), flush=True)
            continue
        results = {way.name: measure(way, args.reads) for way in WAYS}
        print(f"\nround {r + 1}: read p50 (p90), ms, {args.reads} reads each\n")
        print("\n".join(table(results)), flush=True)
        print(f"\nreads over {STALL_S * 1e3:g} ms (the longest, ms)\n")
        print("\n".join(stall_table(results)), flush=True)


if __name__ == "__main__":
    main()
