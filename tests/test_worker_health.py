"""The worker's probe and scrape endpoint (`--health-port`): /health for Kubernetes probes,
/metrics for the engine's own vLLM series."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import Counter

from pdserve.net import free_port
from pdserve.worker.main import _health_server


async def get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = (await reader.read()).decode()
    writer.close()
    return int(data.split(" ", 2)[1]), data.split("\r\n\r\n", 1)[1]


async def test_health_follows_registration_and_metrics_serves_the_registry():
    Counter("vllm_test_probe_total", "a series in the process's default registry").inc()
    worker = SimpleNamespace(links={0: SimpleNamespace(registered=False)}, draining=False)
    port = free_port()
    server = await _health_server(port, worker, host="127.0.0.1")
    try:
        assert (await get(port, "/health"))[0] == 503
        worker.links[0].registered = True
        assert await get(port, "/health") == (200, "ok\n")
        worker.draining = True
        assert (await get(port, "/health"))[0] == 503
        status, body = await get(port, "/metrics")
        assert status == 200 and "vllm_test_probe_total 1.0" in body
    finally:
        server.close()
        await server.wait_closed()


def test_a_taken_kv_port_stops_the_worker_before_its_engine_starts():
    import socket
    import subprocess
    import sys

    with socket.socket() as other:
        other.bind(("127.0.0.1", free_port()))
        other.listen()
        port = other.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "worker", "--role", "decode", "--model",
             "/nonexistent-model", "--controller", "tcp://127.0.0.1:1", "--advertise-host",
             "127.0.0.1", "--kv-port", str(port), "--cores", "0"],
            capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr and "--kv-port" in done.stderr
