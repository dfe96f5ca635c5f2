"""Real engines, shared by every end-to-end test: one `pdserve serve` 1P1D and one plain vLLM
server on the same model (the reference outputs). Each takes ~20-45 s to start."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import Proc, free_port, pdserve, ready_workers, wait_for


def pytest_collection_modifyitems(items):
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@dataclass
class Server:
    base: str
    proc: Proc
    worker_port: int = 0
    keys: str | None = None

    @property
    def v1(self) -> str:
        return self.base + "/v1"


@pytest.fixture(scope="session")
def model_dir() -> str:
    from pdserve.models import ensure_model

    return str(ensure_model("tiny"))


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> str:
    from pdserve.transport import keygen

    folder = tmp_path_factory.mktemp("keys")
    keygen(folder)
    return str(folder)


@pytest.fixture(scope="session")
def pd_server(model_dir, logs, keys):
    port, wport = free_port(), free_port()
    # --verbose: the children's logs in serve's output, where the tests look for engine lines.
    p = Proc("serve", pdserve("serve", "--verbose", "--model", model_dir, "--port", str(port),
                              "--worker-port", str(wport), "--keys", keys,
                              "--controller-arg=--token-timeout=20",
                              # Every prompt length through the handoff, even 1 token.
                              "--controller-arg=--local-prefill-threshold=0"), logs)
    try:
        wait_for(lambda: "pdserve ready" in p.log(), 400, "pdserve serve", [p])
        server = Server(f"http://127.0.0.1:{port}", p, wport, keys)
        yield server
    finally:
        p.stop(90)


@pytest.fixture(scope="session")
def reference(model_dir, logs):
    """vLLM's own server on one plain engine: what pdserve's outputs must equal. On the
    executor a worker's CPU engine runs (the model in the engine core): its multiprocess one
    maps shared memory that a killed run would leave in /dev/shm."""
    from pdserve.worker.engine import IN_ENGINE_CORE_EXECUTOR

    port = free_port()
    p = Proc("reference", [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                           "--model", model_dir, "--dtype", "float32",
                           "--host", "127.0.0.1", "--port", str(port),
                           "--distributed-executor-backend", IN_ENGINE_CORE_EXECUTOR,
                           "--enable-prompt-tokens-details"], logs,
             env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        wait_for(lambda: _health(f"http://127.0.0.1:{port}"), 400, "reference server", [p])
        yield Server(f"http://127.0.0.1:{port}", p)
    finally:
        p.stop(60)


def _health(base: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(base + "/health", timeout=2) as r:
        return r.status == 200


@pytest.fixture(scope="session")
def pd_client(pd_server, model_dir):
    import openai

    return openai.OpenAI(base_url=pd_server.v1, api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="session")
def ref_client(reference):
    import openai

    return openai.OpenAI(base_url=reference.v1, api_key="none", timeout=120, max_retries=0)


@pytest.fixture()
def pool(pd_server):
    return lambda role=None: ready_workers(pd_server.base, role)
