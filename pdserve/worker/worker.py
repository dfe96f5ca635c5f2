"""PDWorker: one engine, serving the controllers it is registered with.

Lifecycle of the worker: connect -> register (retried until acknowledged) -> ready (heartbeats,
serves Generate / Abort) -> draining (on SIGTERM: refuses new work, finishes what it has) ->
unregistered -> exit.

A worker drops a controller's requests only on clear evidence that the controller has dropped
them: it answers that it does not know this worker (`reregister`: it restarted, or declared this
worker dead and moved its requests elsewhere), or it has been silent for its `dead_after` (sent
in its acks; never less than MISSED_ACKS_BEFORE_LOST of its heartbeat intervals). Late acks alone
change nothing: heartbeats go on, and so do the requests. Any message from a controller counts as
hearing from it, and a beat that comes late (this process was stalled, what the controller sent
may be unread) does not count that stall as the controller's silence.

A worker whose engine stops answering a probe it answers between steps (ENGINE_ANSWER_S: the
engine core stopped, paused or hung; vLLM's health check sees only a dead one) holds its
heartbeats until it answers again: its controllers then stall it and move its requests. Still
unanswered after `engine_hung_after`, the engine is taken for hung, as good as dead: the worker
leaves the pool and exits as for a dead one, so that whoever runs it starts a new one.

Heartbeats are sent from the event loop, not from a thread of their own. Late beats come from
overcommitted cores, and a thread gets no more CPU than the loop then; the engine's output
handler yields to the loop between chunks, so outputs do not hold a beat back for long (fake
engine, 256 streams at 14k outputs/s on one loop: 100 ms beats came at most 0.4 s apart); a ZMQ
socket must not be shared between threads, and a second DEALER would be a second peer under the
same identity. Instead the controller counts every Output as a sign of life and treats silence
as suspicion only (pdserve/controller/registry.py).

Lifecycle of a request here: Generate arrives -> task streams the engine's DELTA outputs back as
Output messages -> finished (or aborted by the controller, or failed with an error Output).

The controllers served are found at run time (discovery.py): one link per controller, opened
when it joins the set; one that leaves the set gets a Drain (no new work from it), finishes what
it has here, and is unregistered from and closed. A controller that stops says Leave: its legs
here are aborted at once. The engine's KV cache events are relayed, numbered, to every
registered controller, and replayed to one that asks (kv_events.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from vllm.exceptions import VLLMClientError
from vllm.v1.engine.exceptions import EngineDeadError

from pdserve import protocol, transport
from pdserve.protocol import (
    KV_READ_STATS,
    ErrorKind,
    Output,
    Outputs,
    Phase,
    Role,
    SeqDelta,
    TokenLogprob,
)
from pdserve.worker.discovery import Discovery, siblings
from pdserve.worker.engine import FORCED_TOKENS_ARG, Engine, decode_params

logger = logging.getLogger(__name__)

# A controller silent for its dead_after is gone, but never sooner than this many of its heartbeat
# intervals (tests make it larger: a loaded test machine stalls for seconds).
MISSED_ACKS_BEFORE_LOST = 3
MAX_BATCH = 256  # outputs in one Outputs message
# How long a draining worker stays up after a prefill it finished, for the KV to be read by the
# decode worker (or, with none left, for the controller to go on from it here): the engine's
# blocks go with it. The controller says when the decode's first output is in (an Abort).
HANDOFF_WAIT_S = 5.0
# Seconds before the other controllers hear of decode slots a controller's streams freed: time
# for it to fill them from its own line (a few ms from the stream's end, more under load).
FREED_AFTER = 0.1
# An engine that has not answered its worker's probe for this long (between two steps; this
# process's own stall not counted), nor kept a core busy meanwhile (a long step: EngineProbe),
# has stopped: stopped by a signal, paused, or hung. Its worker then holds its heartbeats, so
# that its controllers give it no work and, after their --move-after, move its requests, as for
# a worker that stopped itself.
ENGINE_ANSWER_S = 5.0
# A controller that has left this worker's registration unanswered this long is said to, again
# each time as long again: one at a wrong address, or holding other keys (CurveZMQ drops such a
# peer without a word), would otherwise leave the worker waiting in silence.
REGISTER_PATIENCE_S = 30.0


class EngineHung(RuntimeError):
    """The engine has not answered its worker's probe for `engine_hung_after` seconds."""


class _Steps:
    """Decode steps seen since the last heartbeat: the gaps between a stream's outputs, and how
    many streams were running then (what the controllers' cost models fit step time on)."""

    __slots__ = ("gaps", "n", "streams")

    def __init__(self) -> None:
        self.gaps, self.n, self.streams = 0.0, 0, 0

    def add(self, gap: float, streams: int) -> None:
        self.gaps += gap
        self.n += 1
        self.streams += streams

    def take(self) -> tuple[float, float]:
        """(mean gap, mean streams), (0, 0) when none; then start again."""
        out = (self.gaps / self.n, self.streams / self.n) if self.n else (0.0, 0.0)
        self.gaps, self.n, self.streams = 0.0, 0, 0
        return out


@dataclass
class _Link:
    """This worker's connection to one controller."""

    url: str
    sock: zmq.asyncio.Socket
    registered: bool = False
    session: str = field(default_factory=lambda: uuid.uuid4().hex)  # see protocol.Register
    refused: str | None = None
    controller_id: str = ""
    last_heard: float = field(default_factory=time.monotonic)  # any message from it
    interval: float = 1.0
    dead_after: float = 0.0  # the controller's, from its acks
    siblings: tuple[int, ...] = ()  # worker ports of the API servers beside it, from its acks
    retiring: bool = False  # gone from the controller set: finishing its legs, then closed
    # Its streams headed here, their prompts being prefilled elsewhere (protocol.Reserved).
    reserved: int = 0
    reserves: bool = False  # it takes protocol.Others (its acks say so)
    others_told: int = 0  # the last `others` it was sent
    asking_since: float = field(default_factory=time.monotonic)  # unregistered since
    said_unanswered: float = 0.0  # how long it had been unanswered when last said
    # Outputs made during this turn of the event loop, sent together at its end (see flush).
    pending: list[Output] = field(default_factory=list)
    # Told of outputs that could not be sent (the worker ends their legs: see _outputs_dropped).
    dropped: Callable[[list[Output]], None] | None = None

    def unregister(self) -> None:
        """Its legs are dropped: the next Register starts a new session."""
        self.registered, self.session = False, uuid.uuid4().hex
        self.reserved = 0
        self.asking_since, self.said_unanswered = time.monotonic(), 0.0

    def send(self, msg: protocol._Msg) -> None:
        """Send now, after the outputs made before it (the controller must see a leg's outputs
        before, say, the Unregister that fails it). Raises zmq.Again as send_nowait does."""
        self.flush()
        transport.send_nowait(self.sock, msg)

    def queue(self, out: Output) -> None:
        """Send `out` with every other output made in this turn of the event loop: all the
        streams an engine step advanced wake in the same turn, so they go as one message."""
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append(out)
        if len(self.pending) >= MAX_BATCH or out.prompt_logprobs is not None:
            self.flush()  # bounds a message: prompt logprobs can be megabytes alone

    def flush(self) -> None:
        if not self.pending:
            return
        outs, self.pending = self.pending, []
        try:
            transport.send_nowait(self.sock, outs[0] if len(outs) == 1 else Outputs(outs))
        except zmq.Again:
            logger.warning("controller %s unreachable: dropped the outputs of %s", self.url,
                           ", ".join(sorted({o.request_id for o in outs})))
            if self.dropped is not None:
                self.dropped(outs)
        except zmq.ZMQError as e:  # closed under us: its controller left
            logger.info("link to %s closed: dropped %d outputs (%s)", self.url, len(outs), e)

    def say_if_unanswered(self, now: float, worker_id: str) -> None:
        """Warn, every REGISTER_PATIENCE_S, while the controller leaves this worker's
        registration unanswered."""
        waited = now - self.asking_since
        if waited - self.said_unanswered >= REGISTER_PATIENCE_S:
            self.said_unanswered = waited
            logger.warning("worker %s: controller %s has not answered this worker's registration "
                           "for %.0f s: check that one listens there and that it and this worker "
                           "hold the same keys (--keys)", worker_id, self.url, waited)

    def gone(self, now: float, stall: float = 0.0) -> bool:
        """Silent for too long, not counting `stall` (this process's own, see the loop)."""
        limit = max(self.dead_after, MISSED_ACKS_BEFORE_LOST * self.interval)
        return self.registered and now - self.last_heard - stall > limit


class PDWorker:
    def __init__(self, engine: Engine, role: Role, controllers: list[str] | Discovery, *,
                 worker_id: str | None = None, address: str = "127.0.0.1", kv_port: int = 0,
                 keys: transport.Keys | None = None, heartbeat_interval: float = 1.0,
                 drain_timeout: float = 600.0, discovery_interval: float | None = None,
                 engine_hung_after: float = 0.0):
        self.discovery = (controllers if isinstance(controllers, Discovery)
                          else Discovery(controllers))
        self.discovery_interval = discovery_interval or heartbeat_interval
        self.engine = engine
        self.role = role
        self.worker_id = worker_id or f"{role.label}-{uuid.uuid4().hex[:8]}"
        self.address = address
        self.kv_port = kv_port
        self.heartbeat_interval = heartbeat_interval
        self.drain_timeout = drain_timeout
        self.engine_hung_after = engine_hung_after  # 0: never
        self.draining = False
        self.ctx = zmq.asyncio.Context()
        self.keys = keys
        self.links: dict[int, _Link] = {}  # by link id, which never repeats
        self._telling = False  # a _tell_others of slots taken is due at the end of this turn
        self._freeing: asyncio.TimerHandle | None = None  # and one of slots freed, later
        self._loops: dict[int, asyncio.Task] = {}  # each link's receive loop
        self._next_link = 0
        self._found: set[str] = set()  # the controller set as discovery last gave it
        self._running = False
        # Tasks nobody awaits (KV event replays, engine aborts of legs whose outputs dropped),
        # held here so they are not collected mid-run (see _spawn).
        self._background: set[asyncio.Task] = set()
        for url in sorted(self.discovery.static() or ()):  # literal addresses: no lookup
            self._found.add(url)
            self._open(url)
        self.tasks: dict[tuple[int, str], asyncio.Task] = {}  # by (link id, request id)
        self._steps = _Steps()
        # Decode legs whose task has not started: aborted now, their engine would never see
        # them, so the prefill worker's blocks must be released from here.
        self.unstarted: dict[tuple[int, str], dict] = {}
        # Prefill legs whose last output has not been forwarded: aborted, their engine may have
        # finished them already (holding their blocks for a decode) with that output on its way
        # here, which the abort drops; vLLM's abort of a finished request frees nothing.
        self.prefilling: set[tuple[int, str]] = set()
        # Prefill legs finished here whose KV may not have been read yet: until when a draining
        # worker waits for it (HANDOFF_WAIT_S), oldest first.
        self.handing: dict[tuple[int, str], float] = {}
        self.stopped = asyncio.Event()
        self.engine_dead = False
        self.engine_stopped = False  # its engine leaves the probe unanswered (ENGINE_ANSWER_S)
        self.left = False  # unregistered from every controller

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until stop() or drain() completes, or every controller refused this worker."""
        self._running = True
        for i in self.links:
            self._loops[i] = asyncio.create_task(self._recv_loop(i))
        loops = [asyncio.create_task(self._heartbeat_loop())]
        if self.engine.kv_events is not None:
            loops.append(asyncio.create_task(self._relay_kv_events()))
        if self.discovery.static() is None:
            loops.append(asyncio.create_task(self._discovery_loop()))
        try:
            await self.stopped.wait()
        finally:
            loops += self._loops.values()
            for t in loops:
                t.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await self._abort_all()
            self._leave("stopped")  # no-op after a drain: the controllers move what was left
            await asyncio.sleep(0.05)  # let it leave before the sockets close
            self.ctx.destroy(linger=0)

    def stop(self) -> None:
        self.stopped.set()

    async def _engine_died(self, e: BaseException) -> None:
        """Leave every pool at once and stop with a failure exit code, so that whoever runs the
        worker (`pdserve serve`, systemd, Kubernetes) starts a new one: a dead vLLM engine does
        not come back."""
        if self.engine_dead:
            return
        self.engine_dead = True
        logger.error("worker %s: its engine died (%s: %s); leaving the pool", self.worker_id,
                     type(e).__name__, e)
        self._leave(f"engine died: {e}")
        await asyncio.sleep(0.1)  # let the unregister leave before the sockets close
        self.stop()

    async def drain(self) -> None:
        """Stop taking requests, finish the ones in flight, unregister, stop."""
        if self.draining:
            return
        self.draining = True
        logger.info("worker %s draining: %d requests in flight", self.worker_id, len(self.tasks))
        self._tell_all(protocol.Drain(self.worker_id))
        deadline = time.monotonic() + self.drain_timeout
        said = False
        while (self.tasks or self._handing()) and time.monotonic() < deadline:
            if not self.tasks and not said:
                said = True
                logger.info("worker %s: its requests are done; waiting (%.0f s at most) for the "
                            "KV of %d prefills to be read", self.worker_id, HANDOFF_WAIT_S,
                            len(self.handing))
            await asyncio.sleep(0.05)
        if self.tasks:
            logger.warning("drain timeout: aborting %d requests", len(self.tasks))
            await self._abort_all()
        registered = any(link.registered for link in self.links.values())
        self._leave("drained")
        await asyncio.sleep(0.1)  # let the unregister leave before the sockets close
        logger.info("worker %s drained and %s", self.worker_id, "unregistered" if registered
                    else "stopped: no controller had answered its registration")
        self.stop()

    def _handing(self) -> bool:
        """Whether a prefill finished here may still be read or gone on from (forgets those
        past their wait)."""
        now = time.monotonic()
        while self.handing and next(iter(self.handing.values())) <= now:
            del self.handing[next(iter(self.handing))]
        return bool(self.handing)

    def _leave(self, reason: str) -> None:
        """Unregister from every controller, once."""
        if not self.left:
            self.left = True
            self._tell_all(protocol.Unregister(self.worker_id, reason))

    @property
    def refused_by_all(self) -> bool:
        return bool(self.links) and all(lk.refused for lk in self.links.values())

    def _tell_all(self, msg) -> None:
        # Never wait: a DEALER whose controller is gone would block a send forever.
        for link in self.links.values():
            try:
                link.send(msg)
            except zmq.Again:
                logger.warning("controller %s unreachable: %s not sent", link.url,
                               type(msg).__name__)

    # ---- the controller set (discovery.py) -------------------------------------------------

    async def _discovery_loop(self) -> None:
        while True:
            self._found = await self.discovery.find()
            self._apply()
            await asyncio.sleep(self.discovery_interval)

    def _apply(self) -> None:
        """Open a link to each controller new in the set; retire the links to those gone."""
        want = set(self._found)
        for link in list(self.links.values()):
            if link.url in self._found:
                want |= siblings(link.url, link.siblings)
        have = {link.url for link in self.links.values()}  # retiring ones too, see _retire
        for url in sorted(want - have):
            self._open(url)
        for i, link in list(self.links.items()):
            if link.url not in want and not link.retiring:
                self._retire(i)

    def _open(self, url: str) -> None:
        i, self._next_link = self._next_link, self._next_link + 1
        self.links[i] = _Link(url, transport.worker_socket(self.ctx, url, self.worker_id,
                                                           self.keys),
                              dropped=lambda outs: self._outputs_dropped(i, outs))
        if self._running:
            logger.info("controller %s joined the set: registering", url)
            self._loops[i] = asyncio.create_task(self._recv_loop(i))

    def _retire(self, i: int) -> None:
        """A controller gone from the set gets no new work from here; what it has running
        finishes (it may be draining its clients' streams), then the link closes. A controller
        that comes back meanwhile is registered with again once this link has closed: a new
        registration now would make it fail the legs that are finishing."""
        link = self.links[i]
        link.retiring = True
        running = self._count(i)
        if not link.registered or not running:
            self._close(i, "left the controller set")
            return
        logger.info("controller %s left the set: finishing its %d requests, then leaving it",
                    link.url, running)
        try:
            link.send(protocol.Drain(self.worker_id))
        except zmq.Again:
            pass

    def _close(self, i: int, reason: str) -> None:
        link = self.links.pop(i)
        loop = self._loops.pop(i, None)
        if loop is not None:
            loop.cancel()
        if link.registered:
            try:
                link.send(protocol.Unregister(self.worker_id, reason))
            except zmq.Again:
                pass
        link.flush()
        link.sock.close(linger=500)  # the unregister still goes out
        logger.info("closed the link to controller %s: %s", link.url, reason)

    # ---- KV events (worker/kv_events.py) ----------------------------------------------------

    async def _relay_kv_events(self) -> None:
        """Every batch of the engine's KV events to every controller this worker serves."""
        assert self.engine.kv_events is not None
        try:
            async for seq, payload in self.engine.kv_events.live():
                self._relay_batch(seq, payload)
        except zmq.ZMQError as e:  # the controllers route without this worker's events
            logger.warning("worker %s: its engine's KV events stopped (%s); controllers will "
                           "route on their own estimate of its cache", self.worker_id, e)

    def _relay_batch(self, seq: int, payload: bytes) -> None:
        msg = protocol.KvEvents(self.worker_id, seq, msgspec.Raw(payload))
        for link in self.links.values():
            if link.registered:
                try:
                    link.send(msg)
                except zmq.Again:
                    pass  # the controller sees the gap and asks for a replay

    async def _replay_kv_events(self, i: int, start: int) -> None:
        assert self.engine.kv_events is not None
        try:
            batches = await self.engine.kv_events.replay(start)
        except (zmq.ZMQError, OSError) as e:
            logger.warning("KV event replay from %d failed: %s", start, e)
            return
        link = self.links.get(i)
        for seq, payload in batches:
            if link is None or not link.registered:
                return
            try:
                link.send(protocol.KvEvents(self.worker_id, seq,
                                                                   msgspec.Raw(payload)))
            except zmq.Again:
                return

    # ---- control plane ---------------------------------------------------------------------

    def _register_msg(self, link: _Link) -> protocol.Register:
        return protocol.Register(self.worker_id, self.role, self.address, self.engine.info,
                                 kv_port=self.kv_port, pid=os.getpid(),
                                 kv_events=self.engine.kv_events is not None,
                                 kv_blocks=self.engine.kv_blocks,
                                 kv_block_bytes=self.engine.kv_block_bytes,
                                 max_seqs=self.engine.max_seqs, session=link.session,
                                 reserves=True)

    async def _heartbeat_loop(self) -> None:
        beat = time.monotonic()
        while True:
            try:
                await self.engine.check_health()
            except Exception as e:  # a dead engine: leave the pool rather than fail every request
                await self._engine_died(e)
                return
            now = time.monotonic()
            stall, beat = max(0.0, now - beat - self.heartbeat_interval), now
            unanswered = self.engine.unanswered() - stall
            if 0 < self.engine_hung_after < unanswered:
                await self._engine_died(EngineHung(
                    f"it has not answered for {unanswered:.0f} s (--engine-hung-after)"))
                return
            silent = self._engine_stopped(unanswered)
            load = self._load()
            for i, link in list(self.links.items()):
                if link.refused:
                    continue
                if link.gone(now, stall):
                    logger.warning("controller %s silent for %.0f s: aborting its %d requests, "
                                   "registering again when it is back", link.url,
                                   now - link.last_heard, self._count(i))
                    link.unregister()
                    await self._abort_link(i)
                if link.retiring and (not link.registered or not self._count(i)):
                    self._close(i, "left the controller set")
                    continue
                if silent:
                    continue
                msg: protocol.Heartbeat | protocol.Register
                if link.registered:
                    others = self._others(i)
                    if self._freeing is not None:  # slots freed this moment: not yet (FREED_AFTER)
                        others = max(others, link.others_told)
                    link.others_told = others
                    msg = protocol.Heartbeat(self.worker_id,
                                             msgspec.structs.replace(load, others=others),
                                             self.draining or link.retiring)
                else:
                    msg = self._register_msg(link)
                    link.say_if_unanswered(now, self.worker_id)
                try:
                    link.send(msg)
                except zmq.Again:
                    pass  # not connected yet; the next beat tries again
            await asyncio.sleep(self.heartbeat_interval)

    def _engine_stopped(self, unanswered: float) -> bool:
        """Whether the engine has left its probe unanswered for ENGINE_ANSWER_S; says when
        that begins and ends."""
        stopped = unanswered > ENGINE_ANSWER_S
        if stopped and not self.engine_stopped:
            logger.warning("worker %s: its engine has not answered for %.0f s (it does not "
                           "step): no heartbeats until it does, so that the controllers send "
                           "it nothing and move its %d requests", self.worker_id, unanswered,
                           len(self.tasks))
        elif self.engine_stopped and not stopped:
            logger.info("worker %s: its engine answers again: heartbeats resume",
                        self.worker_id)
        self.engine_stopped = stopped
        return stopped

    def _load(self) -> protocol.Load:
        """The engine's load, with the decode steps seen since the last heartbeat. vLLM reports
        its figures after each step, so an engine that went idle keeps reporting the requests of
        its last step until it steps again: they are capped at the legs this worker has in it."""
        load = self.engine.load()
        legs = len(self.tasks)
        running = min(load.running, legs)
        step_s, step_running = self._steps.take()
        return msgspec.structs.replace(load, running=running,
                                       waiting=min(load.waiting, legs - running),
                                       step_s=step_s, step_running=step_running)

    async def _recv_loop(self, i: int) -> None:
        link = self.links[i]
        while True:
            frames = await link.sock.recv_multipart()
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as e:
                logger.warning("dropped a message from %s: %s", link.url, e)
                continue
            link.last_heard = time.monotonic()
            try:
                if isinstance(msg, protocol.RegisterAck):
                    await self._on_ack(i, msg)
                elif isinstance(msg, protocol.Generate):
                    self._on_generate(i, msg)
                elif isinstance(msg, protocol.Abort):
                    await self._on_abort(i, msg.request_ids)
                elif isinstance(msg, protocol.Reserved):
                    self._on_reserved(i, msg.count)
                elif isinstance(msg, protocol.Ping):
                    pass  # hearing it is all it is for
                elif isinstance(msg, protocol.Leave):
                    await self._on_leave(i, msg)
                elif isinstance(msg, protocol.KvReplay):
                    self._spawn(self._replay_kv_events(i, msg.start))
                else:
                    logger.warning("dropped a %s from %s: not a controller message",
                                   type(msg).__name__, link.url)
            except Exception:  # a handler bug must not stop this controller's loop
                logger.exception("error handling a %s from %s", type(msg).__name__, link.url)

    async def _on_ack(self, i: int, ack: protocol.RegisterAck) -> None:
        link = self.links[i]
        if ack.accepted:
            if not link.registered:
                logger.info("registered with controller %s (%s) as %s %s", link.url,
                            ack.controller_id, self.role.label, self.worker_id)
            link.registered, link.controller_id = True, ack.controller_id
            link.interval, link.dead_after = ack.heartbeat_interval, ack.dead_after
            link.reserves = ack.reserves
            if tuple(ack.siblings) != link.siblings:
                link.siblings = tuple(ack.siblings)
                self._apply()
        elif ack.reregister:
            # The controller failed this worker's legs over already (or never had them): running
            # them on here would only cost the engine.
            if link.registered:
                logger.warning("controller %s no longer knows this worker: aborting its %d "
                               "requests, registering again", link.url, self._count(i))
            link.unregister()
            await self._abort_link(i)
        else:
            link.refused = ack.reason
            logger.error("controller %s refused this worker: %s", link.url, ack.reason)
            if self.refused_by_all:
                self.stop()

    async def _on_leave(self, i: int, msg: protocol.Leave) -> None:
        """The controller is stopping: its legs are gone with it; register again if it is
        still in the set when it is back (a restart at the same address)."""
        link = self.links[i]
        logger.info("controller %s (%s) is leaving (%s): aborting its %d requests", link.url,
                    msg.controller_id, msg.reason or "no reason given", self._count(i))
        link.unregister()
        for key in [k for k in self.handing if k[0] == i]:
            del self.handing[key]
        await self._abort_link(i)

    # ---- requests --------------------------------------------------------------------------

    def _count(self, i: int) -> int:
        return sum(1 for (j, _) in self.tasks if j == i)

    def _others(self, i: int) -> int:
        """This engine's slots held for controllers other than link `i`'s: their requests here
        and their streams headed here (protocol.Load.others)."""
        return (len(self.tasks) - self._count(i)
                + sum(link.reserved for j, link in self.links.items() if j != i))

    def _on_reserved(self, i: int, count: int) -> None:
        link = self.links[i]
        if link.registered and count != link.reserved:
            link.reserved = max(0, count)
            self._others_changed()

    def _others_changed(self) -> None:
        """Tell the controllers whose `others` changed (a decode engine's slots are what they
        count): slots taken at the end of this turn of the loop, slots freed FREED_AFTER later.
        A slot freed by one controller's stream is that controller's first: it admits the next
        of its line at once, and the others, told at the same moment, would each admit into it
        too."""
        if not self.role.serves(Role.DECODE):
            return
        loop = asyncio.get_running_loop()
        if not self._telling:
            self._telling = True
            loop.call_soon(self._tell_others, True)
        if self._freeing is None:
            self._freeing = loop.call_later(FREED_AFTER, self._tell_others, False)

    def _tell_others(self, taken_only: bool) -> None:
        """Each controller that takes it and whose `others` rose (or, unless `taken_only`,
        changed) since it was last told, in a protocol.Others: at once, not a heartbeat later."""
        if taken_only:
            self._telling = False
        else:
            self._freeing = None
        for i, link in list(self.links.items()):
            if not (link.registered and link.reserves):
                continue
            others = self._others(i)
            if others > link.others_told or (not taken_only and others != link.others_told):
                link.others_told = others
                try:
                    link.send(protocol.Others(self.worker_id, others))
                except zmq.ZMQError:
                    pass  # full or closed: the next heartbeat says it

    def _on_generate(self, i: int, msg: protocol.Generate) -> None:
        key = (i, msg.request_id)
        link = self.links[i]
        goes_on = (msg.continues is not None  # see Generate
                   and self.handing.pop((i, msg.continues), None) is not None)
        refusal = self._refusal(link, goes_on, msg.phase)
        if refusal:
            self._reply(i, Output(msg.request_id, [], finished=True, error=refusal,
                                  error_kind=ErrorKind.DRAINING))
            return
        if key in self.tasks:
            logger.warning("duplicate request id %s ignored", msg.request_id)
            return
        task = asyncio.create_task(self._serve(i, msg, time.monotonic()))
        self.tasks[key] = task
        if msg.phase == Phase.DECODE and isinstance(msg.kv_transfer_params, dict):
            self.unstarted[key] = msg.kv_transfer_params
        elif msg.phase == Phase.PREFILL:
            self.prefilling.add(key)
        task.add_done_callback(lambda _t: self._ended(key))
        self._others_changed()

    def _refusal(self, link: _Link, goes_on: bool, phase: Phase) -> str:
        """Why a leg from `link` is not run here ("" if it is). A release is run whenever the
        link serves: any decode worker can have a prefill engine free blocks, and the
        controller expects no answer to it. Another leg that arrives before this worker's
        registration was acknowledged was meant for an earlier worker of the same id (its
        connection was taken over): the controller fails it when the Register lands, and
        running it would only cost the engine."""
        if link.refused or link.retiring:
            return "worker is draining"
        if phase == Phase.RELEASE:
            return ""
        if not link.registered:
            return "worker is not registered with this controller yet"
        if self.draining and not goes_on:
            return "worker is draining"
        return ""

    def _hand(self, key: tuple[int, str]) -> None:
        self._handing()  # the oldest forgotten first: the dict stays bounded
        self.handing[key] = time.monotonic() + HANDOFF_WAIT_S

    def _ended(self, key: tuple[int, str]) -> None:
        self.tasks.pop(key, None)
        self.prefilling.discard(key)
        self._others_changed()

    async def _on_abort(self, i: int, request_ids: list[str]) -> None:
        await self._end_in_engine(self._cancel(i, request_ids))

    def _cancel(self, i: int, request_ids: list[str]) -> _Ending:
        """Cancel these legs of link i at once (none sends another output), and say what the
        engine must still be told (_Ending). Only this controller's own requests: another's
        ids are not its to abort. An id named twice is cancelled once."""
        request_ids = list(dict.fromkeys(request_ids))
        owned = [rid for rid in request_ids if (i, rid) in self.tasks]
        for rid in owned:
            self.tasks.pop((i, rid)).cancel()
        unstarted = [(rid, kv) for rid in request_ids
                     if (kv := self.unstarted.pop((i, rid), None)) is not None]
        prefills = [rid for rid in owned if (i, rid) in self.prefilling]
        self.prefilling.difference_update((i, rid) for rid in prefills)
        for rid in request_ids:  # a finished prefill's: its KV was read (or never will be)
            self.handing.pop((i, rid), None)
        return _Ending(owned, unstarted, prefills)

    async def _end_in_engine(self, ending: _Ending) -> None:
        if ending.owned:
            await self.engine.abort(ending.owned)
        for rid, kv in ending.unstarted:
            await self.engine.release(rid, kv)
        if ending.prefills:  # after the abort: one still running is freed by it
            await self.engine.release_held(ending.prefills)

    def _outputs_dropped(self, i: int, outs: list[Output]) -> None:
        """Outputs that never reached their controller (its queue was full): a later output of
        the same leg would leave a hole in the client's stream, so the legs end here, and the
        controller is told they failed (it moves them on, with what it did stream; if this
        cannot reach it either, its gap timeout does the same). An error that could not be
        sent is not sent again. A prefill's last output dropped names blocks its controller
        will never release: the engine frees them."""
        rids = list(dict.fromkeys(o.request_id for o in outs if o.error is None))
        ending = self._cancel(i, rids)
        ending.prefills += [o.request_id for o in outs if o.finished and o.kv_transfer_params
                            and "remote_block_ids" in o.kv_transfer_params]
        for rid in rids:
            self._reply(i, Output(rid, [], finished=True, error_kind=ErrorKind.ENGINE,
                                  error="its outputs to the controller were dropped (the "
                                        "controller's queue was full)"))
        if ending.owned or ending.unstarted or ending.prefills:
            self._spawn(self._end_in_engine(ending))

    async def _release(self, i: int, rid: str, kv: dict) -> None:
        """A controller's release of blocks no decode will read: held by a prefill engine
        elsewhere (kv names it: this engine tells it), or by this one (the requests named, as
        this engine reported them, when the controller had no decode worker to ask)."""
        held = kv.get(protocol.RELEASE_HELD)
        if held is None:
            await self.engine.release(rid, kv)
        elif isinstance(held, list) and all(isinstance(r, str) for r in held):
            for r in held:  # named as the engine named them
                self.handing.pop((i, protocol.leg_of(r)), None)
            await self.engine.release_held(held)
        else:
            raise ValueError(f"{protocol.RELEASE_HELD} must be a list of request ids")

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_link(self, i: int) -> None:
        await self._on_abort(i, [rid for (j, rid) in list(self.tasks) if j == i])

    async def _abort_all(self) -> None:
        for i in list(self.links):
            await self._abort_link(i)

    def _reply(self, i: int, out: Output) -> None:
        link = self.links.get(i)
        if link is not None:  # else closed: its controller left, and aborted what it had here
            link.queue(out)

    async def _serve(self, i: int, msg: protocol.Generate, received: float) -> None:
        rid = msg.request_id
        self.unstarted.pop((i, rid), None)  # from here on the engine owns it, and its abort
        try:
            params = decode_params(msg.sampling_params)
            params = _params_for_phase(params, msg)
            if msg.phase == Phase.RELEASE:
                await self._release(i, rid, msg.kv_transfer_params or {})
                return
            finished, first = False, msg.phase == Phase.DECODE
            last = 0.0  # when this leg's previous output came out (0: none yet)
            async for ro in self.engine.generate(rid, msg.prompt_token_ids, params):
                out = to_output(ro)
                if first:
                    out.timings, first = handoff_times(received, ro), False
                self._reply(i, out)
                finished = ro.finished
                if finished and (i, rid) in self.prefilling:  # its controller has the
                    self.prefilling.discard((i, rid))  # prefill's blocks to release, if need be
                    if out.kv_transfer_params:
                        self._hand((i, rid))
                now = time.monotonic()
                if last:  # a decode step of this stream
                    self._steps.add(now - last, len(self.tasks))
                last = now
            if not finished:  # never forwarded as a whole answer
                raise RuntimeError("the engine's stream ended before the request finished")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine refused or failed: tell the controller why
            kind = (ErrorKind.DEAD if isinstance(e, EngineDeadError) else
                    ErrorKind.INVALID if isinstance(e, _REFUSED) else ErrorKind.ENGINE)
            logger.warning("request %s failed on %s: %s: %s", rid, self.worker_id,
                           type(e).__name__, e)
            self._reply(i, Output(rid, [], finished=True, error=f"{type(e).__name__}: {e}",
                                  error_kind=kind))
            if kind == ErrorKind.DEAD:
                await self._engine_died(e)


@dataclass
class _Ending:
    """What the engine must still be told of legs cancelled here: the legs it runs, the
    unstarted decode legs whose prefill blocks it must release, and the prefill legs whose
    last output was not forwarded (their blocks may be held for a decode: release_held)."""

    owned: list[str]
    unstarted: list[tuple[str, dict]]
    prefills: list[str]


# The engine refused the request itself (e.g. VLLMClientError: an out-of-vocabulary token id):
# any other worker would refuse it too.
_REFUSED = (ValueError, TypeError, VLLMClientError)


def _params_for_phase(params, msg: protocol.Generate):
    """Set the KV-transfer parameters from the message, never from the client's sampling params."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.DELTA
    extra = dict(params.extra_args or {})
    extra.pop("kv_transfer_params", None)
    extra.pop(FORCED_TOKENS_ARG, None)
    if msg.forced_tokens:
        extra[FORCED_TOKENS_ARG] = list(msg.forced_tokens)
    if msg.phase == Phase.PREFILL:
        extra["kv_transfer_params"] = {"do_remote_decode": True}
        # A per-request generator kills a CPU engine when a chunked prefill's sample is
        # discarded (vLLM 0.32); a prefill's token never needs one (see first_token.py).
        params.seed = None
    elif msg.phase in (Phase.DECODE, Phase.RELEASE):
        if not isinstance(msg.kv_transfer_params, dict):
            raise ValueError("decode request without kv_transfer_params")
        extra["kv_transfer_params"] = {**msg.kv_transfer_params, KV_READ_STATS: True}
    params.extra_args = extra or None
    return params


def handoff_times(received: float, ro) -> list[float] | None:
    """protocol.Output.timings of a decode leg's first output, from vLLM's request stats
    (the engine core's monotonic clock is this host's, as this process's is)."""
    m = getattr(ro, "metrics", None)
    if m is None or not getattr(m, "first_token_ts", 0.0):
        return None
    return [received, m.queued_ts, m.scheduled_ts, m.first_token_ts, time.monotonic()]


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
