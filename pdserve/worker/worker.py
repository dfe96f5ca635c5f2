"""PDWorker: one engine, serving the controllers it is registered with.

Lifecycle of the worker: connect -> register (retried until acknowledged) -> ready (heartbeats,
serves Generate / Abort) -> draining (on SIGTERM: refuses new work, finishes what it has) ->
unregistered -> exit. A controller that stops acknowledging heartbeats is treated as gone: its
requests are aborted here and the worker registers again once it answers.

Lifecycle of a request here: Generate arrives -> task streams the engine's DELTA outputs back as
Output messages -> finished (or aborted by the controller, or failed with an error Output).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from vllm.exceptions import VLLMClientError

from pdserve import protocol, transport
from pdserve.protocol import ErrorKind, Output, Phase, Role, SeqDelta, TokenLogprob
from pdserve.worker.engine import Engine

logger = logging.getLogger(__name__)

MISSED_ACKS_BEFORE_LOST = 3


@dataclass
class _Link:
    """This worker's connection to one controller."""

    url: str
    sock: zmq.asyncio.Socket
    registered: bool = False
    refused: str | None = None
    controller_id: str = ""
    last_ack: float = field(default_factory=time.monotonic)
    interval: float = 1.0


class PDWorker:
    def __init__(self, engine: Engine, role: Role, controllers: list[str], *,
                 worker_id: str | None = None, address: str = "127.0.0.1", kv_port: int = 0,
                 keys: transport.Keys | None = None, heartbeat_interval: float = 1.0,
                 drain_timeout: float = 600.0):
        if not controllers:
            raise ValueError("a worker needs at least one --controller")
        self.engine = engine
        self.role = role
        self.worker_id = worker_id or f"{role.name.lower()}-{uuid.uuid4().hex[:8]}"
        self.address = address
        self.kv_port = kv_port
        self.heartbeat_interval = heartbeat_interval
        self.drain_timeout = drain_timeout
        self.draining = False
        self.ctx = zmq.asyncio.Context()
        self.links = [transport.worker_socket(self.ctx, url, self.worker_id, keys)
                      for url in controllers]
        self.links = [_Link(url, sock) for url, sock in zip(controllers, self.links)]
        self.tasks: dict[tuple[int, str], asyncio.Task] = {}
        # Decode legs whose task has not started: aborted now, their engine would never see
        # them, so the prefill worker's blocks must be released from here.
        self.unstarted: dict[tuple[int, str], dict] = {}
        self.stopped = asyncio.Event()
        self.served = 0

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until stop() or drain() completes, or every controller refused this worker."""
        loops = [asyncio.create_task(self._recv_loop(i)) for i in range(len(self.links))]
        loops.append(asyncio.create_task(self._heartbeat_loop()))
        try:
            await self.stopped.wait()
        finally:
            for t in loops:
                t.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await self._abort_all()
            self.ctx.destroy(linger=0)

    def stop(self) -> None:
        self.stopped.set()

    async def drain(self) -> None:
        """Stop taking requests, finish the ones in flight, unregister, stop."""
        if self.draining:
            return
        self.draining = True
        logger.info("worker %s draining: %d requests in flight", self.worker_id, len(self.tasks))
        self._tell_all(protocol.Drain(self.worker_id))
        deadline = time.monotonic() + self.drain_timeout
        while self.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.tasks:
            logger.warning("drain timeout: aborting %d requests", len(self.tasks))
            await self._abort_all()
        self._tell_all(protocol.Unregister(self.worker_id, "drained"))
        await asyncio.sleep(0.1)  # let the unregister leave before the sockets close
        logger.info("worker %s drained and unregistered", self.worker_id)
        self.stop()

    def _tell_all(self, msg) -> None:
        # Never wait: a DEALER whose controller is gone would block a send forever.
        for link in self.links:
            try:
                transport.send_nowait(link.sock, msg)
            except zmq.Again:
                logger.warning("controller %s unreachable: %s not sent", link.url,
                               type(msg).__name__)

    # ---- control plane ---------------------------------------------------------------------

    def _register_msg(self) -> protocol.Register:
        return protocol.Register(self.worker_id, self.role, self.address, self.engine.info,
                                 kv_port=self.kv_port, pid=os.getpid())

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self.engine.check_health()
            except Exception as e:  # a dead engine: leave the pool rather than fail every request
                logger.error("worker %s: engine failed its health check (%s: %s); leaving the "
                             "pool", self.worker_id, type(e).__name__, e)
                self._tell_all(protocol.Unregister(self.worker_id, f"engine failed: {e}"))
                await asyncio.sleep(0.1)  # let the unregister leave before the sockets close
                self.stop()
                return
            now = time.monotonic()
            for i, link in enumerate(self.links):
                if link.refused:
                    continue
                if link.registered and now - link.last_ack > MISSED_ACKS_BEFORE_LOST * link.interval:
                    logger.warning("controller %s stopped answering: aborting its %d requests, "
                                   "registering again when it is back", link.url,
                                   self._count(i))
                    link.registered = False
                    await self._abort_link(i)
                if link.registered:
                    msg = protocol.Heartbeat(self.worker_id, self.engine.load(), self.draining)
                else:
                    msg = self._register_msg()
                try:
                    transport.send_nowait(link.sock, msg)
                except zmq.Again:
                    pass  # not connected yet; the next beat tries again
            await asyncio.sleep(self.heartbeat_interval)

    async def _recv_loop(self, i: int) -> None:
        link = self.links[i]
        while True:
            frames = await link.sock.recv_multipart()
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as e:
                logger.warning("dropped a message from %s: %s", link.url, e)
                continue
            try:
                if isinstance(msg, protocol.RegisterAck):
                    self._on_ack(link, msg)
                elif isinstance(msg, protocol.Generate):
                    self._on_generate(i, msg)
                elif isinstance(msg, protocol.Abort):
                    await self._on_abort(i, msg.request_ids)
                else:
                    logger.warning("dropped a %s from %s: not a controller message",
                                   type(msg).__name__, link.url)
            except Exception:  # a handler bug must not stop this controller's loop
                logger.exception("error handling a %s from %s", type(msg).__name__, link.url)

    def _on_ack(self, link: _Link, ack: protocol.RegisterAck) -> None:
        link.last_ack = time.monotonic()
        if ack.accepted:
            if not link.registered:
                logger.info("registered with controller %s (%s) as %s %s", link.url,
                            ack.controller_id, self.role.name.lower(), self.worker_id)
            link.registered, link.controller_id = True, ack.controller_id
            link.interval = ack.heartbeat_interval
        elif ack.reregister:
            link.registered = False
        else:
            link.refused = ack.reason
            logger.error("controller %s refused this worker: %s", link.url, ack.reason)
            if all(lk.refused for lk in self.links):
                self.stop()

    # ---- requests --------------------------------------------------------------------------

    def _count(self, i: int) -> int:
        return sum(1 for (j, _) in self.tasks if j == i)

    def _on_generate(self, i: int, msg: protocol.Generate) -> None:
        key = (i, msg.request_id)
        if self.draining or self.links[i].refused:
            self._reply(i, Output(msg.request_id, [], finished=True, error="worker is draining",
                                  error_kind=ErrorKind.DRAINING))
            return
        if key in self.tasks:
            logger.warning("duplicate request id %s ignored", msg.request_id)
            return
        task = asyncio.create_task(self._serve(i, msg))
        self.tasks[key] = task
        if msg.phase == Phase.DECODE and isinstance(msg.kv_transfer_params, dict):
            self.unstarted[key] = msg.kv_transfer_params
        task.add_done_callback(lambda _t: self.tasks.pop(key, None))

    async def _on_abort(self, i: int, request_ids: list[str]) -> None:
        # Only this controller's own requests: another's ids are not its to abort.
        owned = [rid for rid in request_ids if (i, rid) in self.tasks]
        for rid in owned:
            self.tasks.pop((i, rid)).cancel()
        if owned:
            await self.engine.abort(owned)
        for rid in request_ids:
            kv = self.unstarted.pop((i, rid), None)
            if kv is not None:
                await self.engine.release(rid, kv)

    async def _abort_link(self, i: int) -> None:
        await self._on_abort(i, [rid for (j, rid) in list(self.tasks) if j == i])

    async def _abort_all(self) -> None:
        for i in range(len(self.links)):
            await self._abort_link(i)

    def _reply(self, i: int, out: Output) -> None:
        try:
            transport.send_nowait(self.links[i].sock, out)
        except zmq.Again:
            logger.warning("controller %s unreachable: dropped output of %s",
                           self.links[i].url, out.request_id)

    async def _serve(self, i: int, msg: protocol.Generate) -> None:
        rid = msg.request_id
        self.unstarted.pop((i, rid), None)  # from here on the engine owns it, and its abort
        try:
            params = self.engine.decode_params(msg.sampling_params)
            params = _params_for_phase(params, msg)
            if msg.phase == Phase.RELEASE:
                await self.engine.release(rid, msg.kv_transfer_params or {})
                return
            async for ro in self.engine.generate(rid, msg.prompt_token_ids, params):
                self._reply(i, to_output(ro))
            self.served += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine refused or failed: tell the controller why
            kind = ErrorKind.INVALID if isinstance(e, _REFUSED) else ErrorKind.ENGINE
            logger.warning("request %s failed on %s: %s: %s", rid, self.worker_id,
                           type(e).__name__, e)
            self._reply(i, Output(rid, [], finished=True, error=f"{type(e).__name__}: {e}",
                                  error_kind=kind))


# The engine refused the request itself (e.g. VLLMClientError: an out-of-vocabulary token id):
# any other worker would refuse it too.
_REFUSED = (ValueError, TypeError, VLLMClientError)


def _params_for_phase(params, msg: protocol.Generate):
    """Set the KV-transfer parameters from the message, never from the client's sampling params."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.DELTA
    extra = dict(params.extra_args or {})
    extra.pop("kv_transfer_params", None)
    if msg.phase == Phase.PREFILL:
        extra["kv_transfer_params"] = {"do_remote_decode": True}
    elif msg.phase in (Phase.DECODE, Phase.RELEASE):
        if not isinstance(msg.kv_transfer_params, dict):
            raise ValueError("decode request without kv_transfer_params")
        extra["kv_transfer_params"] = dict(msg.kv_transfer_params)
    params.extra_args = extra or None
    return params


def _logprobs(entries) -> list[TokenLogprob]:
    return [TokenLogprob(tid, float(lp.logprob), lp.rank, lp.decoded_token)
            for tid, lp in entries.items()]


def to_output(ro) -> Output:
    """A vLLM RequestOutput (DELTA kind) as a wire Output."""
    seqs = [
        SeqDelta(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            logprobs=None if c.logprobs is None else [_logprobs(p) for p in c.logprobs],
            cumulative_logprob=c.cumulative_logprob,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in ro.outputs
    ]
    prompt_lps = None
    if ro.prompt_logprobs is not None:
        prompt_lps = [None if p is None else _logprobs(p) for p in ro.prompt_logprobs]
    return Output(ro.request_id, seqs, finished=ro.finished,
                  num_cached_tokens=ro.num_cached_tokens,
                  kv_transfer_params=ro.kv_transfer_params, prompt_logprobs=prompt_lps)
