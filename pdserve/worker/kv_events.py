"""The engine's KV cache events, read where vLLM publishes them, for the worker to relay.

vLLM's ZmqEventPublisher (enabled by `kv_events_config`, engine.py) sends each scheduler step's
events as [topic, seq (8 bytes, big-endian), msgpack KVEventBatch] on a PUB socket, and keeps the
last `buffer_steps` batches for replay on a ROUTER: a DEALER sends [b"", start (8 bytes)] and
gets [b"", topic, seq, payload] for every kept batch from `start` on, then [b"", b"", -1, b""].
The worker forwards the payload bytes untouched (protocol.KvEvents); controllers decode them
(controller/kvindex.py). Both sockets are ipc endpoints on this host: the engine core binds them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Protocol

import zmq
import zmq.asyncio

TOPIC = b"kv"
REPLAY_TIMEOUT_S = 5.0
_END = (-1).to_bytes(8, "big", signed=True)
# Engine steps kept for replay: a controller that joins or misses a batch asks for them. 10,000
# steps of a busy engine is minutes; older blocks stay unknown to a late controller (misses,
# never false hits: kvindex.py).
BUFFER_STEPS = 10_000


class KvEventSource(Protocol):
    """What PDWorker relays: the engine's live event batches, and a replay of kept ones."""

    def live(self) -> AsyncIterator[tuple[int, bytes]]: ...

    async def replay(self, start: int) -> list[tuple[int, bytes]]: ...

    def close(self) -> None: ...


def endpoints(tag: str) -> tuple[str, str]:
    """ipc endpoints for one engine's publisher and replay socket, where vLLM puts its own
    sockets (names shorter than vLLM's, so the paths fit a unix socket's 107 bytes there)."""
    from vllm import envs

    base = os.path.join(envs.VLLM_RPC_BASE_PATH, f"pdserve-kv-{tag}")
    return f"ipc://{base}", f"ipc://{base}-replay"


def events_config(endpoint: str, replay_endpoint: str) -> dict:
    """vLLM's KVEventsConfig fields for a publisher this worker can read."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
            "replay_endpoint": replay_endpoint, "topic": TOPIC.decode(),
            "buffer_steps": BUFFER_STEPS}


class ZmqKvEvents:
    def __init__(self, endpoint: str, replay_endpoint: str):
        self.ctx = zmq.asyncio.Context()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)

    async def live(self) -> AsyncIterator[tuple[int, bytes]]:
        while True:
            frames = await self.sub.recv_multipart()
            if len(frames) == 3:
                yield int.from_bytes(frames[1], "big", signed=True), frames[2]

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        """The kept batches from `start` on (what the engine still has)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", max(0, start).to_bytes(8, "big")])
            while await sock.poll(REPLAY_TIMEOUT_S * 1000):
                frames = await sock.recv_multipart()
                if len(frames) != 4 or frames[2] == _END:
                    break
                out.append((int.from_bytes(frames[2], "big", signed=True), frames[3]))
        finally:
            sock.close()
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        for ep in (self.endpoint, self.replay_endpoint):
            try:
                os.unlink(ep.removeprefix("ipc://"))
            except OSError:
                pass
