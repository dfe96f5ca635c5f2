"""A started worker leaves its startup heap out of the garbage collector's full collections
(pdserve/worker/main.py `freeze_startup_heap`), as vLLM's API server does before it serves. Left
in, each full collection walked torch's and vLLM's objects with the worker's event loop stopped,
and every stream on the worker paused for it."""

from __future__ import annotations

import asyncio
import gc

from vllm.engine.arg_utils import AsyncEngineArgs

from pdserve.worker import main


class StubEngine:
    """No engine process: the heap the worker freezes is this test process's own."""

    def __init__(self, settings, engine_args) -> None:
        self.settings = settings
        self.stopped = False

    def shutdown(self) -> None:
        self.stopped = True


class StubWorker:
    """Serves nothing: notes whether the heap was frozen by the time the worker serves."""

    frozen_when_serving: int | None = None

    def __init__(self, engine, role, discovery, **_settings) -> None:
        self.worker_id = "decode-stub"
        self.links: dict = {}
        self.engine_dead = False
        self.refused_by_all = False

    async def run(self) -> None:
        StubWorker.frozen_when_serving = gc.get_freeze_count()


def test_a_worker_freezes_the_heap_it_started_with_before_it_serves(monkeypatch):
    monkeypatch.setattr("pdserve.worker.engine.VllmEngine", StubEngine)
    monkeypatch.setattr("pdserve.worker.worker.PDWorker", StubWorker)
    monkeypatch.setattr(main, "stop_on_signals", lambda worker: None)
    monkeypatch.setattr(AsyncEngineArgs, "from_cli_args", classmethod(lambda cls, args: None))
    args = main.make_parser().parse_args(["--role", "decode", "--model", "tiny",
                                          "--controller", "tcp://127.0.0.1:9"])
    StubWorker.frozen_when_serving = None
    gc.unfreeze()  # whatever an earlier test in this process froze
    try:
        assert asyncio.run(main.run(args, main.StartSignals())) == 0
    finally:
        gc.unfreeze()
    assert StubWorker.frozen_when_serving  # every object the process held by then
