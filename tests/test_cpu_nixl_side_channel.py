"""The connector's start with its KV side-channel port taken (pdserve/kv/cpu_nixl.py): vLLM's
engine would wait for its listener for good; the start fails with the reason instead."""

from __future__ import annotations

import socket

import pytest

from pdserve.kv import cpu_nixl
from pdserve.net import free_port


class FakeScheduler:
    """What vLLM's NIXL scheduler side exposes here: its side channel and the listener start."""

    def __init__(self, port: int):
        self.side_channel_host, self.side_channel_port = "127.0.0.1", port
        self._nixl_handshake_listener_t = None
        self.served: list[dict] = []

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        self.served.append(metadata)


def connector(port: int) -> cpu_nixl.PDCpuNixlConnector:
    c = object.__new__(cpu_nixl.PDCpuNixlConnector)  # no engine: only the start is tested
    c.connector_scheduler = FakeScheduler(port)
    return c


def test_a_free_side_channel_starts_vllms_listener() -> None:
    c = connector(free_port())
    c.set_xfer_handshake_metadata_pp_aware({(0, 0): b"meta"})
    assert c.connector_scheduler.served == [{(0, 0): b"meta"}]


def test_a_taken_side_channel_fails_the_start_with_the_port_named() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", free_port()))
        other.listen()
        port = other.getsockname()[1]
        c = connector(port)
        with pytest.raises(cpu_nixl.SideChannelTaken, match=f"127.0.0.1:{port}"):
            c.set_xfer_handshake_metadata_pp_aware({(0, 0): b"meta"})
    assert c.connector_scheduler.served == []  # vLLM's listener never started
