"""The one place that makes pdserve's ZMQ sockets: bind vs connect, limits, CurveZMQ.

Topology: each controller binds one ROUTER; each worker connects one DEALER per controller,
with its worker id as the ZMQ identity. All messages of a pair travel over that connection.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from pdserve import protocol

logger = logging.getLogger(__name__)

# Deliberate high-water marks: a token stream is many small messages, so the limit is high, and
# the ROUTER is "mandatory" so that a full or vanished peer raises instead of dropping silently.
SEND_HWM = 100_000
RECV_HWM = 100_000
LINGER_MS = 0  # on close, unsent messages are dropped: their requests are failed anyway
# Messages taken per wakeup of the event loop: a burst of outputs costs one wakeup, and a
# flood still lets the streams run between batches.
RECV_BATCH = 32

CONTROLLER_KEY = "controller"
WORKER_KEY = "worker"


@dataclass(frozen=True)
class Keys:
    """CurveZMQ key material read from a `pdserve keygen` folder."""

    folder: Path
    controller_public: bytes
    controller_secret: bytes | None
    worker_public: bytes
    worker_secret: bytes | None

    @classmethod
    def load(cls, folder: str | Path) -> Keys:
        folder = Path(folder)

        def pair(name: str) -> tuple[bytes, bytes | None]:
            secret_file = folder / f"{name}.key_secret"
            if secret_file.exists():
                return zmq.auth.load_certificate(secret_file)
            public, _ = zmq.auth.load_certificate(folder / f"{name}.key")
            return public, None

        cp, cs = pair(CONTROLLER_KEY)
        wp, ws = pair(WORKER_KEY)
        return cls(folder, cp, cs, wp, ws)


def keygen(folder: str | Path) -> list[Path]:
    """Write a controller and a worker key pair (public `.key`, secret `.key_secret`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (CONTROLLER_KEY, WORKER_KEY):
        public, secret = zmq.auth.create_certificates(folder, name)
        Path(secret).chmod(0o600)
        written += [Path(public), Path(secret)]
    return written


class Authenticator:
    """ZAP handler that admits only clients holding the worker key (one per context)."""

    def __init__(self, ctx: zmq.Context, keys: Keys):
        self._auth = ThreadAuthenticator(ctx, log=logger)
        self._auth.start()
        authorized = keys.folder / "authorized"
        authorized.mkdir(exist_ok=True)
        # configure_curve reads every *.key in a folder: give it just the worker's public key.
        (authorized / f"{WORKER_KEY}.key").write_bytes(
            (keys.folder / f"{WORKER_KEY}.key").read_bytes())
        self._auth.configure_curve(domain="*", location=str(authorized))

    def stop(self) -> None:
        self._auth.stop()


def _limits(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES + 4096)


def controller_socket(ctx: zmq.asyncio.Context, address: str, keys: Keys | None) -> zmq.asyncio.Socket:
    """The controller's ROUTER, bound at `address` (tcp://HOST:PORT)."""
    sock = ctx.socket(zmq.ROUTER)
    _limits(sock)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its identity
    if keys is not None:
        if keys.controller_secret is None:
            raise ValueError(f"{keys.folder} has no controller secret key")
        sock.curve_server = True
        sock.curve_publickey = keys.controller_public
        sock.curve_secretkey = keys.controller_secret
    sock.bind(address)
    return sock


def worker_socket(ctx: zmq.asyncio.Context, address: str, identity: str,
                  keys: Keys | None) -> zmq.asyncio.Socket:
    """A worker's DEALER, connected to one controller."""
    sock = ctx.socket(zmq.DEALER)
    _limits(sock)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.RECONNECT_IVL, 200)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    if keys is not None:
        if keys.worker_secret is None:
            raise ValueError(f"{keys.folder} has no worker secret key")
        sock.curve_serverkey = keys.controller_public
        sock.curve_publickey = keys.worker_public
        sock.curve_secretkey = keys.worker_secret
    sock.connect(address)
    return sock


async def send(sock: zmq.asyncio.Socket, msg: protocol._Msg, to: bytes | None = None) -> None:
    frames = protocol.encode(msg)
    await sock.send_multipart(frames if to is None else [to, *frames], copy=False)


def send_nowait(sock: zmq.asyncio.Socket, msg: protocol._Msg, to: bytes | None = None) -> None:
    """Send without waiting; raises zmq.Again if the peer's queue is full or it is unreachable."""
    frames = protocol.encode(msg)
    # An asyncio socket reports a failed send on the future it returns, never by raising.
    fut = cast("asyncio.Future[Any]", sock.send_multipart(
        frames if to is None else [to, *frames], flags=zmq.NOBLOCK, copy=False))
    if fut.done():
        fut.result()
    else:  # queued behind a pending send: its error can only be logged
        fut.add_done_callback(_log_failed_send)


def _log_failed_send(fut) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.warning("dropped a message: %s", fut.exception())


class Receiver:
    """Receives from an asyncio socket in batches: the next message and those already queued
    behind it, read without a future each (zmq.asyncio makes one, with a loop callback, per
    message)."""

    def __init__(self, sock: zmq.asyncio.Socket, limit: int = RECV_BATCH):
        self._sock = sock
        self._sync: zmq.Socket = zmq.Socket.shadow(sock.underlying)
        self._limit = limit
        self._full = False

    async def recv(self) -> list[list[bytes]]:
        if self._full:  # a flood: let the rest of the loop run before taking more
            await asyncio.sleep(0)
        batch = [await self._sock.recv_multipart()]
        recv = self._sync.recv
        while len(batch) < self._limit:
            try:
                frame = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            # Frame by frame, reading `more` off each (recv_multipart asks the socket).
            frames = [frame.bytes]
            while frame.more:
                frame = recv(zmq.NOBLOCK, copy=False)
                frames.append(frame.bytes)
            batch.append(frames)
        self._full = len(batch) == self._limit
        return batch
