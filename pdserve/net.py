"""TCP ports: a free one, and whether a server could listen on a given one; how long an HTTP
server keeps an idle connection."""

from __future__ import annotations

import random
import socket
from collections.abc import MutableMapping
from pathlib import Path

_random = random.SystemRandom()  # not the `random` module's state, which callers may seed

# Clients keep an idle connection open longer than vLLM's HTTP server does by default (5 s):
# aiohttp 15 s, Go 90 s, requests and urllib3 until it is closed. A server that closes one first
# races with its reuse, and the request sent on it fails ("Connection reset by peer", "Server
# disconnected"; EvalScope at 320 streams met 6 in 9,073). 75 s is nginx's default.
KEEP_ALIVE_ENV, KEEP_ALIVE_S = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "75"


def keep_idle_connections(env: MutableMapping[str, str]) -> None:
    """Have the vLLM HTTP servers started with `env` keep idle connections KEEP_ALIVE_S, unless
    the user chose."""
    env.setdefault(KEEP_ALIVE_ENV, KEEP_ALIVE_S)


def _bind_host(host: str) -> str:
    return "" if host == "0.0.0.0" else host


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now, below the kernel's ephemeral range when there is
    room: a port from that range (what binding port 0 gives) is also what every outgoing
    connection on the host takes, so in the seconds before its server binds it (an engine's KV
    side channel binds ~30 s after its worker chose the port) a connection could take it first.
    Kubernetes' NodePorts are left out too, so that kube-proxy's rules on the host cannot catch
    the port's traffic. Another process may still bind it first."""
    first, end = _below_ephemeral()
    for _ in range(64 if first < end else 0):
        port = _random.randrange(first, end)
        if bind_error(host, port) is None:
            return port
    with socket.socket() as s:  # no room below the range, or all tried were taken
        s.bind((_bind_host(host), 0))
        return int(s.getsockname()[1])


NODE_PORTS = (30000, 32767)  # Kubernetes' default --service-node-port-range


def _below_ephemeral() -> tuple[int, int]:
    """The window free_port draws from: [first, end)."""
    low, _ = _ephemeral_range()
    return max(1024, low - 16384), min(low, NODE_PORTS[0])


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on host:port now, or None if it could. Binds as uvicorn
    and ZMQ do (SO_REUSEADDR), so a port left in TIME_WAIT by a stopped server counts as free."""
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        return e
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((_bind_host(host), port))
        except OSError as e:
            return e
    return None


def free_ports(n: int, host: str = "127.0.0.1") -> int:
    """The first of `n` consecutive ports nothing listens on at `host` now (the worker ports of
    `pdserve controller --api-servers n`)."""
    for _ in range(100):
        first = free_port(host)
        if first + n <= 65536 and all(bind_error(host, first + i) is None for i in range(1, n)):
            return first
    raise OSError(f"found no {n} consecutive free ports on {host}")
