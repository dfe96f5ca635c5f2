"""TCP ports: a free one, and whether a server could listen on a given one."""

from __future__ import annotations

import socket


def _bind_host(host: str) -> str:
    return "" if host == "0.0.0.0" else host


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now (another process may still take it first)."""
    with socket.socket() as s:
        s.bind((_bind_host(host), 0))
        return int(s.getsockname()[1])


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
