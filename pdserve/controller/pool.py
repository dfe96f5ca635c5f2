"""The controller's side of the control plane: one ROUTER socket, the registry, and a queue per
request leg that the worker's Output messages are delivered to.

A leg is one Generate sent to one worker (a prefill, a decode, or a local run). When a worker dies,
is expired, or cannot be reached, every leg on it gets a `WorkerLost` so no waiter hangs.

A silent worker is only suspect (registry.py), then stalled (its legs move to other workers);
each check sends it a `Ping`. The ROUTER is "mandatory", so a send to a peer whose connection is
gone raises EHOSTUNREACH at once (tried: right after a SIGKILL, with and without CurveZMQ), while
a stalled but living process keeps its connection and the send goes through: a failed probe is
the clear evidence that a suspect is dead.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from pdserve import protocol, transport
from pdserve.controller.kvindex import KVIndex
from pdserve.controller.mailbox import Mailbox
from pdserve.controller.registry import Registry, Worker, WorkerState
from pdserve.protocol import EngineInfo, Role

logger = logging.getLogger(__name__)

# Sampling parameters of a RELEASE leg: an empty map decodes as the defaults (none are used).
_RELEASE_PARAMS = msgspec.Raw(msgspec.msgpack.encode({}))
# How long a release waits for a decode worker to carry it: after vLLM's NIXL abort timeout
# the prefill engine has freed the blocks itself.
RELEASE_RETRY_S = 480.0
# A KV event replay not answered within this is asked for again.
REPLAY_RETRY_S = 2.0
DEFAULT_KV_BLOCKS = 100_000  # a worker's index cap when it does not say its engine's


def _kv_decoder() -> msgspec.msgpack.Decoder:
    global _KV_DECODER
    if _KV_DECODER is None:  # vLLM's event types: imported once the first events arrive
        from vllm.distributed.kv_events import KVEventBatch

        _KV_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
    return _KV_DECODER


_KV_DECODER: msgspec.msgpack.Decoder | None = None


class WorkerLost(Exception):
    """The worker holding a leg died, was expired, or could not be reached."""

    def __init__(self, worker_id: str, why: str):
        super().__init__(f"worker {worker_id} lost: {why}")
        self.worker_id = worker_id


@dataclass
class Leg:
    """One request leg on one worker; outputs (or a WorkerLost) arrive on `queue`."""

    id: str
    worker: Worker
    queue: Mailbox
    done: bool = False
    outputs: int = 0  # Output messages that carried output (not an error) so far
    prefill_tokens: int = 0  # tokens it prefills, counted in its worker's queue until it outputs
    backlog: int = 0  # Outputs on `queue` not read yet
    reads_from: str = ""  # a decode leg: the prefill worker whose KV it reads (its first output)
    # A leg in its worker's prefill line (prefill_tokens > 0): when its wait began (loop time),
    # as sent, and again whenever a prefill sent before it there is done (line_moved).
    waits_since: float = 0.0


def line_moved(line: dict[str, Leg], done: Leg, now: float) -> None:
    """`done`'s prefill came out of its worker's `line` at `now`: the legs sent after it are
    a place further on, and their wait for the prefill timeout starts again."""
    behind = False
    for leg in line.values():
        if behind:
            leg.waits_since = max(leg.waits_since, now)
        behind = behind or leg is done


class Pool:
    def __init__(self, bind: str, *, expected: EngineInfo | None = None,
                 keys: transport.Keys | None = None, heartbeat_interval: float = 1.0,
                 missed_heartbeats: int = 3, move_after: float = 10.0, dead_after: float = 30.0,
                 siblings: list[int] | None = None, kv_index: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.id = f"controller-{uuid.uuid4().hex[:8]}"
        self.siblings = list(siblings or ())  # worker ports of the API servers beside this one
        self.registry = Registry(expected, heartbeat_interval=heartbeat_interval,
                                 missed=missed_heartbeats, move_after=move_after,
                                 dead_after=dead_after, clock=clock)
        self.ctx = zmq.asyncio.Context()
        self.auth = transport.Authenticator(self.ctx, keys) if keys is not None else None
        self.sock = transport.controller_socket(self.ctx, bind, keys)
        self.legs: dict[str, Leg] = {}
        self.changed = asyncio.Event()  # set whenever membership changes (tests and waiters)
        self._tasks: list[asyncio.Task] = []
        self.dropped_messages = 0
        self._unreleased: deque[tuple[dict, str, str, float]] = deque(maxlen=100_000)
        self._watchers: list[Callable[[str, Worker], None]] = []  # membership changes
        self.loop: asyncio.AbstractEventLoop | None = None
        # What every publishing worker's engine holds (kvindex.py); made at the first
        # registration that brings events, with that engine's block size.
        self.kv: KVIndex | None = None
        self._kv_wanted = kv_index
        self._replay_asked: dict[str, float] = {}  # worker id -> when a replay was asked
        self._to_tell: dict[str, Worker] = {}  # decode workers whose `reserved` changed
        # Per worker, its legs still prefilling, in the order sent: a line its engine works
        # through about first come, first served (vLLM's scheduler).
        self._lines: dict[str, dict[str, Leg]] = {}

    def snapshot(self) -> list[dict]:
        """The workers as /pd/workers shows them: the registry's entries, each with what the KV
        index holds for it (`kv_index`; null when its engine's events are not indexed)."""
        views = self.kv.snapshot() if self.kv is not None else {}
        out = self.registry.snapshot()
        for w in out:
            view = views.get(w["id"])
            w["kv_index"] = None if view is None else {
                "blocks": view.blocks, "capacity": view.capacity, "last_seq": view.last_seq,
                "waiting_for_replay": view.stale, "gaps": view.gaps, "resets": view.resets}
        return out

    @property
    def address(self) -> str:
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._recv_loop()),
                       asyncio.create_task(self._expiry_loop())]

    async def close(self) -> None:
        if self.ctx.closed:
            return
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for leg in list(self.legs.values()):
            self._fail(leg, "controller shutting down")
        # Workers free this controller's legs now, not after its dead_after of silence.
        for w in self.registry.workers.values():
            self._reply(w.identity, protocol.Leave(self.id, "controller shutting down"))
        if self.auth is not None:
            self.auth.stop()
        self.sock.close(linger=500)  # the Leave messages still go out
        self.ctx.term()

    # ---- legs ------------------------------------------------------------------------------

    def send(self, worker: Worker, msg: protocol.Generate, prefill_tokens: int = 0) -> Leg:
        """Start a leg; raises WorkerLost at once if the worker cannot be reached.
        `prefill_tokens`: the prompt tokens it prefills (a prefill or local leg)."""
        leg = Leg(msg.request_id, worker, Mailbox(), prefill_tokens=prefill_tokens,
                  waits_since=asyncio.get_running_loop().time())
        self.legs[leg.id] = leg
        if prefill_tokens:
            self._lines.setdefault(worker.id, {})[leg.id] = leg
        worker.inflight += 1
        worker.queued_prefill_tokens += prefill_tokens
        worker.legs_total += 1
        try:
            transport.send_nowait(self.sock, msg, to=worker.identity)
        except zmq.ZMQError as e:  # EHOSTUNREACH (ROUTER_MANDATORY) or a full queue
            self.finish(leg)
            self.lost(worker, f"send failed: {e}")
            raise WorkerLost(worker.id, str(e)) from None
        return leg

    def reserve(self, worker: Worker, n: int) -> None:
        """`n` more (or fewer) of this controller's streams are headed for decode worker
        `worker` while their prompts are prefilled elsewhere. A worker that reserves is told the
        new count at the end of this turn of the event loop (one message for all the changes
        made in it), and tells the other controllers at once."""
        worker.reserved = max(0, worker.reserved + n)
        if worker.reserves:
            if not self._to_tell:
                asyncio.get_running_loop().call_soon(self._tell_reserved)
            self._to_tell[worker.id] = worker

    def _tell_reserved(self) -> None:
        to_tell, self._to_tell = self._to_tell, {}
        for w in to_tell.values():
            if self.registry.workers.get(w.id) is w:
                self._reply(w.identity, protocol.Reserved(w.reserved))

    def finish(self, leg: Leg) -> None:
        if not leg.done:
            leg.done = True
            leg.worker.inflight = max(0, leg.worker.inflight - 1)
            self._prefilled(leg)
            self.legs.pop(leg.id, None)

    def _prefilled(self, leg: Leg, done: bool = False) -> None:
        """The leg's prefill is `done` (its first output came) or will not be: out of the
        queue. A prefill done moves the line: the legs sent after it wait from now."""
        if leg.prefill_tokens:
            w = leg.worker
            w.queued_prefill_tokens = max(0, w.queued_prefill_tokens - leg.prefill_tokens)
            leg.prefill_tokens = 0
            line = self._lines.get(w.id, {})
            if done:
                line_moved(line, leg, asyncio.get_running_loop().time())
            line.pop(leg.id, None)
            if not line:
                self._lines.pop(w.id, None)

    def abort(self, leg: Leg) -> None:
        """Tell the worker to drop the leg (best effort) and stop tracking it."""
        if not leg.done:
            self.finish(leg)
            try:
                transport.send_nowait(self.sock, protocol.Abort([leg.id]), to=leg.worker.identity)
            except zmq.ZMQError:
                pass  # the worker is gone: its engine went with it

    def handed(self, prefill: Leg) -> None:
        """A decode leg's first output is in, so the KV of `prefill` was read: its worker, which
        a drain keeps up until then (at most worker.HANDOFF_WAIT_S), is told, as an Abort of
        the finished leg (which frees nothing). Always, not only to a worker known to be
        draining: one that began meanwhile would wait for nothing."""
        try:
            transport.send_nowait(self.sock, protocol.Abort([prefill.id]),
                                  to=prefill.worker.identity)
        except zmq.ZMQError:
            pass  # the worker is gone: it waits for nothing

    def release_kv(self, kv: dict, leg_id: str, exclude: str = "") -> bool:
        """Have a decode worker (not `exclude`) tell a prefill engine to free blocks no decode
        will read.

        False when no decode worker can take it now: it is retried as one becomes ready.
        """
        if self._send_release(kv, leg_id, exclude):
            return True
        self._unreleased.append((kv, leg_id, exclude,
                                 self.registry.clock() + RELEASE_RETRY_S))
        return False

    def _retry_releases(self) -> None:
        now = self.registry.clock()
        pending, self._unreleased = self._unreleased, deque(maxlen=self._unreleased.maxlen)
        for kv, leg_id, exclude, until in pending:
            if until > now and not self._send_release(kv, leg_id, exclude):
                self._unreleased.append((kv, leg_id, exclude, until))

    def _send_release(self, kv: dict, leg_id: str, exclude: str) -> bool:
        decoders = [w for w in self.registry.ready(Role.DECODE) if w.id != exclude]
        if not decoders:
            return self._release_at_holder(kv, leg_id)
        d = min(decoders, key=lambda w: (w.score(), w.id))
        return self._send_untracked(d, protocol.Generate(
            leg_id, protocol.Phase.RELEASE, [0], _RELEASE_PARAMS, dict(kv)))

    def _release_at_holder(self, kv: dict, leg_id: str) -> bool:
        """No decode worker to carry the release (the pool has none left): ask the prefill
        worker whose engine holds the blocks to free them itself, naming the request as its
        engine reported it. Its engine can with pdserve's CPU connector; with vLLM's own
        (GPU hosts) it does nothing, and the engine's lease frees them."""
        host, port, held = kv.get("remote_host"), kv.get("remote_port"), kv.get("remote_request_id")
        holder = next((w for w in self.registry.workers.values()
                       if w.state != WorkerState.DEAD and w.serves(Role.PREFILL)
                       and w.address == host and w.kv_port == port), None)
        if holder is None or not isinstance(held, str):
            return False
        return self._send_untracked(holder, protocol.Generate(
            leg_id, protocol.Phase.RELEASE, [0], _RELEASE_PARAMS, {protocol.RELEASE_HELD: [held]}))

    def _send_untracked(self, worker: Worker, msg: protocol.Generate) -> bool:
        """Send a leg no answer is expected to."""
        try:
            self.finish(self.send(worker, msg))
        except WorkerLost:
            return False
        return True

    def _release_orphan(self, identity: bytes, msg: protocol.Output) -> None:
        # A prefill that finished after its leg was aborted or timed out: its engine holds
        # blocks for a decode that will never come. Only its own blocks, at its own address.
        w = self.registry.by_identity(identity)
        kv = msg.kv_transfer_params or {}
        if (w is None or not w.serves(Role.PREFILL) or not kv.get("remote_block_ids")
                or kv.get("remote_host") not in (None, w.address)):
            return
        if self.release_kv(kv, f"{msg.request_id}-orphan"):
            logger.info("released the blocks of %s on %s: its request was gone", msg.request_id,
                        w.id)

    def _fail(self, leg: Leg, why: str) -> None:
        leg.queue.put_nowait(WorkerLost(leg.worker.id, why))
        self.finish(leg)

    def watch(self, fn: Callable[[str, Worker], None]) -> None:
        """Call fn(event, worker) on every membership change ("registered", "draining",
        "suspect", "stalled", "cleared", "dead", "unregistered"), as it happens; and with
        "others" when a heartbeat says other controllers hold a different number of its requests
        (its slots free for this one changed)."""
        self._watchers.append(fn)

    def _event(self, event: str, worker: Worker) -> None:
        for fn in self._watchers:
            fn(event, worker)

    def lost(self, worker: Worker, why: str) -> None:
        """The worker can serve nothing more: mark it dead and fail every leg on it, and the
        reads of its KV still under way elsewhere."""
        if self.registry.mark_dead(worker.id) is not None:
            self._forget_kv(worker.id)
            logger.warning("worker %s (%s) is dead: %s", worker.id, worker.role.label, why)
            self._event("dead", worker)
            self.changed.set()
        for leg in [lg for lg in self.legs.values() if lg.worker.id == worker.id]:
            self._fail(leg, why)
        self._fail_reads(worker, why)

    def _stalled(self, worker: Worker, why: str) -> None:
        """The worker is alive (its connection is up) but has said nothing for move_after: its
        legs, and the reads of its KV still under way elsewhere, fail as a dead worker's would,
        so that their sequences move on. Each is aborted where it ran: a stalled worker reads
        that when it wakes (its queue on this socket holds it), and frees the leg."""
        legs = [lg for lg in self.legs.values() if lg.worker.id == worker.id]
        logger.warning("worker %s (%s) is stalled: not heard from for %.1f s; its %d legs move "
                       "to other workers (it is ready again once heard from, dead after %g s)",
                       worker.id, worker.role.label, self.registry.clock() - worker.last_seen,
                       len(legs), self.registry.dead_after)
        self._event("stalled", worker)
        self.changed.set()
        for leg in legs:
            self.abort(leg)
            leg.queue.put_nowait(WorkerLost(worker.id, why))
        self._fail_reads(worker, why)

    def _fail_reads(self, worker: Worker, why: str) -> None:
        """Decode legs elsewhere still reading the KV of `worker` (no output yet) wait on a peer
        that will not answer (a hung one holds the connection open): abort them there, and let
        their sequences prefill again."""
        for leg in [lg for lg in self.legs.values()
                    if lg.reads_from == worker.id and not lg.outputs]:
            self.abort(leg)
            leg.queue.put_nowait(WorkerLost(worker.id, f"its KV was on {worker.id}, {why}"))

    # ---- receiving -------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        receiver = transport.Receiver(self.sock)
        while True:
            for frames in await receiver.recv():
                self._receive(frames)

    def _receive(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        try:
            msg = protocol.decode(body)
        except protocol.VersionMismatch as e:
            logger.warning("refused a peer: %s", e)
            self._reply(identity, protocol.RegisterAck(False, str(e), self.id))
            return
        except protocol.ProtocolError as e:
            self.dropped_messages += 1
            logger.warning("dropped a message: %s", e)
            return
        try:
            self._dispatch(identity, msg)
        except Exception:  # a handler bug must not stop the loop that serves every request
            logger.exception("error handling %s", type(msg).__name__)

    def _dispatch(self, identity: bytes, msg: protocol.Message) -> None:
        if not isinstance(msg, protocol.Register):  # a Register starts a new entry instead
            self._heard(identity)
        if isinstance(msg, protocol.Outputs):
            for out in msg.outputs:
                self._on_output(identity, out)
            return
        if isinstance(msg, protocol.Output):
            self._on_output(identity, msg)
            return
        if isinstance(msg, protocol.KvEvents):
            if self._from(identity, msg.worker_id):
                self._on_kv_events(identity, msg)
            return
        if isinstance(msg, protocol.Others):
            if self._from(identity, msg.worker_id):
                self._on_others(msg)
            return
        if isinstance(msg, protocol.Heartbeat):
            if not self._from(identity, msg.worker_id):
                return
            known = self.registry.workers.get(msg.worker_id)
            others_before = known.load.others if known is not None else 0
            w = self.registry.heartbeat(msg.worker_id, msg.load, msg.draining)
            if w is None:
                self._reply(identity, protocol.RegisterAck(False, "unknown worker", self.id,
                                                           reregister=True))
            else:
                self._reply(identity, self._accepted())
                if msg.load.others != others_before:
                    self._event("others", w)
        elif isinstance(msg, protocol.Register):
            self._on_register(identity, msg)
        elif isinstance(msg, protocol.Drain):
            w = self.registry.drain(msg.worker_id) if self._from(identity, msg.worker_id) else None
            if w is not None:
                logger.info("worker %s is draining", msg.worker_id)
                self._event("draining", w)
                self.changed.set()
        elif isinstance(msg, protocol.Unregister):
            if self._from(identity, msg.worker_id):
                w = self.registry.unregister(msg.worker_id)
                if w is not None:
                    self._forget_kv(w.id)
                    logger.info("worker %s unregistered (%s)", w.id, msg.reason)
                    for leg in [lg for lg in self.legs.values() if lg.worker.id == w.id]:
                        self._fail(leg, "worker unregistered")
                    self._event("unregistered", w)
                    self.changed.set()
        else:
            self.dropped_messages += 1
            logger.warning("dropped a %s: not a worker message", type(msg).__name__)

    def _on_output(self, identity: bytes, msg: protocol.Output) -> None:
        leg = self.legs.get(msg.request_id)
        if leg is not None and leg.worker.identity == identity:
            leg.outputs += msg.error is None
            self._prefilled(leg, done=msg.error is None)
            leg.backlog += 1
            leg.queue.put_nowait(msg)
            if msg.finished:
                self.finish(leg)
        elif leg is None and msg.finished and msg.kv_transfer_params:
            self._release_orphan(identity, msg)

    def _on_others(self, msg: protocol.Others) -> None:
        """Another controller reserved slots on the worker: its figure, before the next beat."""
        w = self.registry.workers.get(msg.worker_id)
        if w is not None and msg.others != w.load.others:
            w.load = msgspec.structs.replace(w.load, others=msg.others)
            self._event("others", w)

    def _from(self, identity: bytes, worker_id: str) -> bool:
        """A worker may only speak for itself (its ZMQ identity is its worker id)."""
        if identity != worker_id.encode():
            self.dropped_messages += 1
            logger.warning("dropped a message for worker %r from identity %r", worker_id, identity)
            return False
        return True

    def _on_register(self, identity: bytes, msg: protocol.Register) -> None:
        if not self._from(identity, msg.worker_id):
            return
        old = self.registry.workers.get(msg.worker_id)
        worker, note = self.registry.register(msg, identity)
        if worker is None:
            logger.error("refused worker %s at %s: %s", msg.worker_id, msg.address, note)
            self._reply(identity, protocol.RegisterAck(False, note, self.id))
            return
        if note == "resent":
            self._reply(identity, self._accepted())
            return
        if old is not None:
            # Registering anew (a restart, or after it dropped its legs): legs on it are gone.
            for leg in [lg for lg in self.legs.values() if lg.worker is old]:
                self._fail(leg, "worker restarted")
        self._index(worker, msg)
        logger.info("worker %s registered: role=%s address=%s:%d model=%s%s%s", worker.id,
                    worker.role.label, worker.address, worker.kv_port, worker.info.model,
                    ", KV events on" if self.kv is not None and msg.kv_events else "",
                    " (replaced its earlier entry)" if note else "")
        self._reply(identity, self._accepted())
        self._event("registered", worker)
        self.changed.set()

    # ---- the KV index ----------------------------------------------------------------------

    def _index(self, worker: Worker, msg: protocol.Register) -> None:
        """A (re)registered worker's engine starts its event stream again: learn it anew,
        from the replay of what its engine kept."""
        if not (self._kv_wanted and msg.kv_events):
            self._forget_kv(worker.id)
            return
        if self.kv is None:
            self.kv = KVIndex(msg.info.block_size, clock=self.registry.clock)
        self.kv.add_worker(worker.id, msg.kv_blocks or DEFAULT_KV_BLOCKS, first_seq=0)

    def _forget_kv(self, worker_id: str) -> None:
        if self.kv is not None:
            self.kv.drop(worker_id)
        self._replay_asked.pop(worker_id, None)

    def _on_kv_events(self, identity: bytes, msg: protocol.KvEvents) -> None:
        w = self.registry.workers.get(msg.worker_id)
        if self.kv is None or w is None or w.identity != identity:
            return
        try:
            batch = _kv_decoder().decode(msg.batch)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.dropped_messages += 1
            logger.warning("dropped KV events %d of %s: %s", msg.seq, w.id, e)
            return
        self.kv.apply(w.id, msg.seq, batch)
        self._ask_replay(w)

    def _ask_replay(self, w: Worker) -> None:
        assert self.kv is not None
        start = self.kv.needs_replay(w.id)
        if start is None:
            self._replay_asked.pop(w.id, None)
            return
        now = self.registry.clock()
        if now - self._replay_asked.get(w.id, -REPLAY_RETRY_S) < REPLAY_RETRY_S:
            return
        self._replay_asked[w.id] = now
        self._reply(w.identity, protocol.KvReplay(start))

    def cached_tokens(self, prompt_keys: list[int], n_tokens: int,
                      workers: list[Worker]) -> dict[str, int | None]:
        """Tokens of a prompt (`prompt_keys` = kvindex.block_keys of it) each worker's engine
        holds, as the KV index knows; None for a worker it cannot speak for (no events, or a
        gap in them): routing then falls back to its own estimate."""
        kv = self.kv
        if kv is None:
            return {w.id: None for w in workers}
        matched = kv.match(prompt_keys, [w.id for w in workers])
        bs = kv.block_size
        return {w.id: (min(matched.get(w.id, 0) * bs, max(0, n_tokens - 1))
                       if kv.exact(w.id) else None) for w in workers}

    def _accepted(self) -> protocol.RegisterAck:
        return protocol.RegisterAck(True, "", self.id, self.registry.heartbeat_interval,
                                    dead_after=self.registry.dead_after, siblings=self.siblings,
                                    reserves=True)

    def _reply(self, identity: bytes, msg) -> None:
        try:
            transport.send_nowait(self.sock, msg, to=identity)
        except zmq.ZMQError:
            pass  # the peer went away between its message and our answer

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.registry.heartbeat_interval / 2)
            self.check_workers()
            if self._unreleased:
                self._retry_releases()
            if self.kv is not None:
                for wid in self.kv.expire():
                    logger.warning("KV events of %s: a gap was not filled in time; its index "
                                   "entries are dropped and learnt again", wid)
                for wid in list(self._replay_asked):
                    if (w := self.registry.workers.get(wid)) is not None:
                        self._ask_replay(w)

    # ---- failure detection -----------------------------------------------------------------

    def check_workers(self) -> None:
        """Suspect the silent, probe them, move the legs of the stalled and fail those of the
        dead (run every half beat)."""
        found = self.registry.expire()
        for w in found.suspected:
            logger.warning("worker %s (%s) is suspect: not heard from for %.1f s; no new work "
                           "until it is, its %d legs keep running", w.id, w.role.label,
                           self.registry.clock() - w.last_seen, w.inflight)
            self._event("suspect", w)
            self.changed.set()
        for w in found.stalled:
            self._stalled(w, f"silent for {self.registry.move_after:g} s")
        for w in found.dead:
            self.lost(w, f"not heard from for {self.registry.dead_after:g} s")
        for w in found.probe:
            self._probe(w)

    def _probe(self, worker: Worker) -> None:
        try:
            transport.send_nowait(self.sock, protocol.Ping(self.id), to=worker.identity)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self.lost(worker, "silent, and its connection is gone")
            # Else its queue is full: connected but not reading, so alive, only slow.

    def _heard(self, identity: bytes) -> None:
        """Any message from a worker shows it alive (identity is the worker id, see _from)."""
        w = self.registry.workers.get(identity.decode(errors="replace"))
        if w is None or w.identity != identity:
            return
        silent = self.registry.clock() - w.last_seen
        if self.registry.heard(w.id):
            logger.info("worker %s spoke after %.1f s of silence: ready again", w.id,
                        silent)
            self._event("cleared", w)
            self.changed.set()
