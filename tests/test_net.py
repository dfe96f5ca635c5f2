"""Ports for servers that bind later: pdserve/net.py."""

from __future__ import annotations

import socket

from pdserve import net


def test_a_free_port_is_below_the_ephemeral_range_and_can_be_listened_on() -> None:
    low, _ = net._ephemeral_range()
    for _ in range(20):
        port = net.free_port()
        assert max(1024, low - 16384) <= port < low  # no outgoing connection is given it
        assert not net.NODE_PORTS[0] <= port <= net.NODE_PORTS[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_port_taken_by_a_listener_is_never_given(monkeypatch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", net.free_port()))
        listener.listen()
        taken = listener.getsockname()[1]
        other = net.free_port()
        tries = iter([taken, taken, other])
        monkeypatch.setattr(net._random, "randrange", lambda a, b: next(tries))
        assert net.free_port() == other


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch) -> None:
    monkeypatch.setattr(net, "_ephemeral_range", lambda: (1024, 65535))
    port = net.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_kubernetes_node_ports_are_never_drawn(monkeypatch) -> None:
    monkeypatch.setattr(net, "_ephemeral_range", lambda: (32768, 60999))
    assert net._below_ephemeral() == (16384, 30000)
    monkeypatch.setattr(net, "_ephemeral_range", lambda: (20000, 60999))
    assert net._below_ephemeral() == (3616, 20000)
