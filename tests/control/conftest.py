"""Fixtures for control-plane tests: a PDController over in-process fake workers, no engine."""

from __future__ import annotations

import os

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from fakepool import HEARTBEAT, MISSED, Cluster, fast_settings  # noqa: E402

from pdserve import fake  # noqa: E402
from pdserve.controller.client import PDController  # noqa: E402
from pdserve.controller.pool import Pool  # noqa: E402
from pdserve.controller.sequence import Settings  # noqa: E402

FAKE_INFO = fake.fake_info()


@pytest.fixture(autouse=True)
def patient_workers(monkeypatch):
    """Workers give up on a silent controller no sooner than after MISSED beats (the controller
    suspects them after as many), even where a test gives the controller a short dead_after."""
    from pdserve.worker import worker

    monkeypatch.setattr(worker, "MISSED_ACKS_BEFORE_LOST", MISSED)


@pytest.fixture(scope="session")
def vllm_config():
    from vllm.engine.arg_utils import AsyncEngineArgs

    from pdserve.models import ensure_model

    model = ensure_model("tiny")
    return AsyncEngineArgs(model=str(model), dtype="float32",
                           enforce_eager=True).create_engine_config()


@pytest.fixture
async def make_cluster(vllm_config):
    """Factory: `await make_cluster(settings=..., heartbeat=..., keys=..., bind=...)`."""
    made: list[Cluster] = []

    async def make(settings: Settings | None = None, heartbeat: float = HEARTBEAT,
                   missed: int = MISSED, move_after: float = 10.0, dead_after: float = 30.0,
                   expected=FAKE_INFO, keys=None,
                   bind: str = "tcp://127.0.0.1:0", siblings: list[int] | None = None,
                   ) -> Cluster:
        pool = Pool(bind, expected=expected, keys=keys, heartbeat_interval=heartbeat,
                    missed_heartbeats=missed, move_after=move_after, dead_after=dead_after,
                    siblings=siblings)
        pool.start()
        c = Cluster(PDController(vllm_config, pool, settings or fast_settings()), heartbeat)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


@pytest.fixture
async def cluster(make_cluster) -> Cluster:
    return await make_cluster()


@pytest.fixture
async def pd(cluster) -> Cluster:
    """One prefill and one decode worker."""
    await cluster.add("prefill")
    await cluster.add("decode")
    return cluster


@pytest.fixture
async def http(make_cluster, vllm_config):
    """`await http(settings)`: an httpx client on vLLM's OpenAI app over a fresh cluster."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    from pdserve.controller.server import add_routes, make_parser

    clients: list[httpx.AsyncClient] = []

    async def make(settings):
        c = await make_cluster(settings=settings)
        args = make_parser().parse_args(["--model", vllm_config.model_config.model])
        tasks = await c.controller.get_supported_tasks()
        app = build_app(args, tasks, c.controller.model_config)
        add_routes(app, c.controller, c.controller.metrics)
        await init_app_state(c.controller, app.state, args, tasks)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                   base_url="http://pdserve", timeout=60)
        clients.append(client)
        return c, client

    yield make
    for client in clients:
        await client.aclose()
