"""Figures for the KV read itself (kv/cpu_nixl.py, worker/engine.py): NIXL over UCX's TCP
transport on loopback, one process holding the blocks (its agent with a progress thread, as a
prefill engine's) and one reading them as a decode engine waits for an in-step read (checking
every 50 us), each on a core of its own. Four ways: the reader's agent with and without a
progress thread, the holder sending the blocks back in UCX's default 8 KB messages and in
pdserve's 32 KB ones (UCX_TCP_TX_SEG_SIZE).

`.venv/bin/python -m pdserve.bench.nixl_read` (~1-2 min; two cores). The sizes are the bench
preset's reads: 4 layers of 128 KB blocks of 128 tokens, one contiguous run per layer.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

PROMPTS = {100: 1, 300: 3, 1000: 8, 2000: 16}  # prompt tokens -> 128-token blocks
LAYERS, BLOCK_BYTES = 4, 128 * 1024
SPAN = 2 * LAYERS * BLOCK_BYTES * max(PROMPTS.values())  # each side's memory: runs apart (_runs)
GAP_S = 0.01  # between reads, as between handoffs
WAYS = [  # (name, the reader's progress thread, UCX_TCP_TX_SEG_SIZE)
    ("thread, 8 KB (before)", True, "8k"),
    ("no thread, 8 KB", False, "8k"),
    ("thread, 32 KB", True, "32k"),
    ("no thread, 32 KB (pdserve)", False, "32k"),
]


def nixl_agent(name: str, progress_thread: bool) -> Any:
    """A NIXL agent over UCX, built as the CPU connector builds an engine's."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    from pdserve.kv.cpu_nixl import cpu_agent

    with cpu_agent(progress_thread):  # vLLM's NIXL worker asks for 4 UCX threads
        return base_worker.NixlWrapper(name, base_worker.nixl_agent_config(num_threads=4))


def _enter(core: int, seg: str) -> None:
    """UCX reads its settings as its first agent starts: set them first, in this process."""
    os.environ.update(UCX_TLS="tcp", UCX_NET_DEVICES="lo", UCX_TCP_TX_SEG_SIZE=seg)
    if core in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {core})


def _hold(conn: Connection, core: int, seg: str) -> None:
    _enter(core, seg)
    agent = nixl_agent("holder", progress_thread=True)
    blocks: np.ndarray = np.ones(SPAN, dtype=np.uint8)
    agent.register_memory([(blocks.ctypes.data, SPAN, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), blocks.ctypes.data))
    conn.recv()  # until the reader is done


def _runs(base: int, total: int) -> list[tuple[int, int, int]]:
    """One descriptor per layer's run of blocks, the runs apart (as layers are)."""
    run = total // LAYERS
    return [(base + i * 2 * run, run, 0) for i in range(LAYERS)]


def _read(conn: Connection, core: int, seg: str, thread: bool, reads: int) -> None:
    from pdserve.kv.cpu_nixl import _POLL_S  # as the connector checks a read it waits for

    _enter(core, seg)
    agent = nixl_agent("reader", progress_thread=thread)
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
            start = time.perf_counter()
            agent.transfer(handle)
            while (state := agent.check_xfer_state(handle)) == "PROC":
                time.sleep(_POLL_S)
            took.append(time.perf_counter() - start)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"a read of {total} bytes ended {state}")
            time.sleep(GAP_S)
        out[tokens] = took[3:]
    conn.send(out)


def measure(thread: bool, seg: str, reads: int) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    hold_end, hold_here = ctx.Pipe()
    read_end, read_here = ctx.Pipe()
    holder = ctx.Process(target=_hold, args=(hold_end, 0, seg), daemon=True)
    reader = ctx.Process(target=_read, args=(read_end, 1, seg, thread, reads), daemon=True)
    holder.start()
    reader.start()
    try:
        read_here.send(hold_here.recv())
        return read_here.recv()
    finally:
        hold_here.send("done")
        for p in (holder, reader):
            p.join(10)
            if p.is_alive():
                p.kill()


def _cells(times: list[float]) -> str:
    ms = np.array(times) * 1e3
    return f"{np.median(ms):.2f} ({np.percentile(ms, 90):.2f})"


def table(results: dict[str, dict[int, list[float]]]) -> Iterator[str]:
    yield "| prompt tokens | KB read | " + " | ".join(results) + " |"
    yield "|---" * (2 + len(results)) + "|"
    for tokens, blocks in PROMPTS.items():
        cells = " | ".join(_cells(r[tokens]) for r in results.values())
        yield f"| {tokens} | {blocks * LAYERS * BLOCK_BYTES // 1024} | {cells} |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.nixl_read", description=__doc__)
    p.add_argument("--reads", type=int, default=60, help="reads per size and way")
    p.add_argument("--rounds", type=int, default=1, help="each way this many times, in turn")
    args = p.parse_args(argv)
    for r in range(args.rounds):
        results = {name: measure(thread, seg, args.reads) for name, thread, seg in WAYS}
        print(f"\nround {r + 1}: read p50 (p90), ms, {args.reads} reads each\n")
        print("\n".join(table(results)), flush=True)


if __name__ == "__main__":
    main()
