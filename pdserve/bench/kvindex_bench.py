"""Figures for controller/kvindex.py: building a 1M-block index, its memory, lookup latency.

`.venv/bin/python -m pdserve.bench.kvindex_bench` (one core, ~40 s, most of it in the traced
builds). Prompts are 2000 tokens in blocks of 16 (125 blocks), stored as vLLM stores them: one
BlockStored per prompt.
"""

from __future__ import annotations

import random
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from pdserve.controller.kvindex import EventBatch, KVIndex, block_keys

BLOCK, PROMPT = 16, 2000
TOTAL = 1_000_000


def _stored(tokens: list[int], hashes: list[int]) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                       block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)


def _batch(*events: Any) -> EventBatch:
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=0.0, events=list(events))


def build(workers: int, rng: random.Random) -> tuple[KVIndex, float]:
    """TOTAL blocks of distinct prompts spread over workers; the seconds apply() took."""
    index = KVIndex(BLOCK, max_blocks=2 * TOTAL)
    nblocks = PROMPT // BLOCK
    prompts = TOTAL // nblocks // workers
    busy = 0.0
    for w in range(workers):
        index.add_worker(f"w{w}", capacity=2 * TOTAL)
        for p in range(prompts):
            base = (w * prompts + p) * PROMPT
            batch = _batch(_stored(list(range(base, base + PROMPT)),
                                   [rng.getrandbits(64) for _ in range(nblocks)]))
            t = time.perf_counter()
            index.apply(f"w{w}", p, batch)
            busy += time.perf_counter() - t
    return index, busy


def _per_call(fn: Callable[[], object], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def memory_mb(workers: int, rng: random.Random) -> float:
    """MB that TOTAL blocks take (tracemalloc: a build of its own, tracing slows it down)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index, _ = build(workers, rng)
    mb = (tracemalloc.get_traced_memory()[0] - before) / 2**20
    tracemalloc.stop()
    del index
    return mb * 1_000_000 / TOTAL


def bench_lookup(workers: int, rng: random.Random) -> dict[str, float]:
    index, busy = build(workers, rng)
    # One probe prompt held at staggered depths, the deepest worker holding all of it: the
    # walk covers every block and every worker drops out somewhere.
    probe = [rng.randrange(150_000) for _ in range(PROMPT)]
    nblocks = PROMPT // BLOCK
    for w in range(workers):
        depth = nblocks * (w + 1) // workers
        ev = _stored(probe[:depth * BLOCK], [rng.getrandbits(64) for _ in range(depth)])
        seq = index.snapshot()[f"w{w}"].last_seq
        index.apply(f"w{w}", 0 if seq is None else seq + 1, _batch(ev))
    keys = block_keys(probe, BLOCK)
    assert index.match(keys)[f"w{workers - 1}"] == nblocks
    miss = block_keys([t + 1 for t in probe], BLOCK)
    subset = [f"w{w}" for w in range(0, workers, max(1, workers // 8))]
    return {
        "blocks": len(index),
        "build_s": busy,
        "blocks_per_s": TOTAL / busy,
        "block_keys_us": _per_call(lambda: block_keys(probe, BLOCK), 2000) * 1e6,
        "match_us": _per_call(lambda: index.match(keys), 20_000) * 1e6,
        "match_8_of_them_us": _per_call(lambda: index.match(keys, subset), 20_000) * 1e6,
        "miss_us": _per_call(lambda: index.match(miss), 20_000) * 1e6,
    }


def main() -> None:
    rng = random.Random(0)
    for workers in (8, 64):
        r = bench_lookup(workers, rng)
        print(f"{workers} workers: {r['blocks']:,} blocks applied in {r['build_s']:.2f} s "
              f"({r['blocks_per_s'] / 1e6:.2f} M blocks/s), "
              f"{memory_mb(workers, rng):.0f} MB per million blocks; "
              f"block_keys(2000 tokens) {r['block_keys_us']:.1f} us; "
              f"match(125 blocks) {r['match_us']:.1f} us, "
              f"over 8 named workers {r['match_8_of_them_us']:.1f} us, "
              f"first-block miss {r['miss_us']:.2f} us")


if __name__ == "__main__":
    main()
