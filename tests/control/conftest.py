"""Fixtures for control-plane tests: a PDController over in-process fake workers, no engine."""

from __future__ import annotations

import os

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
                   missed: int = MISSED, dead_after: float = 30.0, expected=FAKE_INFO, keys=None,
                   bind: str = "tcp://127.0.0.1:0", siblings: list[int] | None = None,
                   ) -> Cluster:
        pool = Pool(bind, expected=expected, keys=keys, heartbeat_interval=heartbeat,
                    missed_heartbeats=missed, dead_after=dead_after, siblings=siblings)
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
