"""The controller's HTTP socket sends each streamed chunk at once: its connections have
TCP_NODELAY (asyncio would not set it on them; see server.http_socket)."""

from __future__ import annotations

import socket

from pdserve.controller import server
from pdserve.models import ensure_model


def test_connections_to_the_http_socket_have_nodelay():
    args = server.make_parser().parse_args(
        ["--model", str(ensure_model("tiny")), "--host", "127.0.0.1", "--port", "0"])
    _, listener = server.http_socket(args)
    listener.listen()  # as uvicorn does with it
    try:
        client = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
        assert conn.proto == 0  # what makes asyncio skip it
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        conn.close()
        client.close()
    finally:
        listener.close()
