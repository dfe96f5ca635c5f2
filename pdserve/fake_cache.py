"""A fake engine's prefix cache, publishing KV events the way vLLM's engine does.

Full blocks of each computed prompt are kept, least recently used first out, up to `capacity`.
Each scheduler-step-like change is one vLLM KVEventBatch (BlockStored with the new blocks'
hashes, their parent's hash and their tokens; BlockRemoved for evictions), numbered from 0 and
kept for replay, as vLLM's ZmqEventPublisher does. Block hashes are salted per engine, as a real
engine's hash seed would make them, so a controller cannot rely on them matching across engines.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence

import msgspec

BUFFER_STEPS = 10_000


class FakePrefixCache:
    def __init__(self, block_size: int, capacity: int, salt: int):
        self.block_size = block_size
        self.capacity = capacity
        self.salt = salt
        self._blocks: OrderedDict[int, int] = OrderedDict()  # chain key -> engine hash
        self._seq = 0
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self._live: asyncio.Queue[tuple[int, bytes]] | None = None
        self.dropped = 0  # batches not published (tests cut the stream with it)
        self.drop_next = 0

    def _chain(self, tokens: Sequence[int]) -> list[tuple[int, list[int]]]:
        out, key, bs = [], 0, self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            block = list(tokens[start:start + bs])
            key = hash((key, tuple(block)))
            out.append((key, block))
        return out

    def cached_tokens(self, prompt: Sequence[int]) -> int:
        """Leading tokens of `prompt` held (never all of it: the last one is always computed)."""
        n = 0
        for key, _ in self._chain(prompt):
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            n += self.block_size
        return min(n, len(prompt) - 1)

    def store(self, prompt: Sequence[int]) -> None:
        """Keep the prompt's full blocks, as vLLM caches a computed (or received) prompt."""
        from vllm.distributed.kv_events import BlockRemoved

        events: list = []
        parent: int | None = None
        new: list[tuple[int, list[int]]] = []
        for key, block in self._chain(prompt):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                if new:  # not expected (a prefix's tail held without its head): start again
                    events.append(self._stored(new, parent))
                    new = []
                parent = self._blocks[key]
            else:
                new.append((key, block))
        if new:
            events.append(self._stored(new, parent))
            for key, _ in new:
                self._blocks[key] = hash((self.salt, key))
        evicted = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[1])
        if evicted:
            events.append(BlockRemoved(block_hashes=evicted, medium="GPU"))
        if events:
            self._publish(events)

    def _stored(self, new: list[tuple[int, list[int]]], parent: int | None):
        from vllm.distributed.kv_events import BlockStored

        return BlockStored(block_hashes=[hash((self.salt, k)) for k, _ in new],
                           parent_block_hash=parent,
                           token_ids=[t for _, block in new for t in block],
                           block_size=self.block_size, lora_id=None, medium="GPU",
                           lora_name=None)

    def clear(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared

        self._blocks.clear()
        self._publish([AllBlocksCleared()])

    def _publish(self, events: list) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events))
        item = (self._seq, payload)
        self._seq += 1
        self._kept.append(item)
        if self.drop_next:
            self.drop_next -= 1
            self.dropped += 1
        elif self._live is not None:
            self._live.put_nowait(item)

    # ---- worker.kv_events.KvEventSource ------------------------------------------------------

    async def live(self) -> AsyncIterator[tuple[int, bytes]]:
        self._live = asyncio.Queue()
        while True:
            yield await self._live.get()

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        return [item for item in self._kept if item[0] >= start]

    def close(self) -> None:
        self._live = None
