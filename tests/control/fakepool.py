"""Test helpers: a controller (PDController + Pool) with in-process PDWorkers around FakeEngines.

Tests add workers with `await cluster.add("prefill", 2)` and drive requests with
`await cluster.run(prompt, params)`; `assert_clean()` checks that nothing is stranded anywhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from pdserve import fake
from pdserve.controller.client import PDController
from pdserve.controller.sequence import Settings
from pdserve.protocol import Role
from pdserve.worker.worker import PDWorker

HEARTBEAT = 0.1
# Expiry (both ways: controller -> worker, worker -> controller) is generous so that a stalled
# event loop on a loaded machine does not expire healthy peers; tests of expiry wait with a bound.
MISSED = 20


def greedy(max_tokens: int = 8, kind: RequestOutputKind = RequestOutputKind.DELTA,
           **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=kind, **kw)


def final_tokens(outs, kind: RequestOutputKind = RequestOutputKind.DELTA,
                 index: int = 0) -> list[int]:
    """A sequence's whole output from the RequestOutputs of one request."""
    seqs = [c for o in outs for c in o.outputs if c.index == index]
    if kind == RequestOutputKind.DELTA:
        return [t for c in seqs for t in c.token_ids]
    return list(seqs[-1].token_ids)


def retries(cluster, kind: str) -> float:
    """pdserve_retries_total of one kind ("prefill_retry", "migration") so far."""
    return cluster.controller.metrics.registry.get_sample_value(
        "pdserve_retries_total", {"kind": kind}) or 0.0


async def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or pred}")
        await asyncio.sleep(0.02)


async def cancelled_after(task: asyncio.Task, turns: int) -> bool:
    """Cancel `task` after `turns` turns of the event loop. True when the cancel found it still
    running, which must then end it with CancelledError wherever it was (Python 3.11's
    asyncio.wait_for swallows a cancel that comes just as what it waits on finishes)."""
    for _ in range(turns):
        await asyncio.sleep(0)
    if not task.cancel():
        return False
    try:
        await task
    except asyncio.CancelledError:
        return True
    raise AssertionError(f"cancelled after {turns} turns of the loop, it went on and returned")


def fast_settings(**kw) -> Settings:
    """Request settings with short waits, so that a failing test fails fast."""
    kw.setdefault("queue_timeout", 1.0)
    kw.setdefault("prefill_timeout", 5.0)
    kw.setdefault("token_timeout", 5.0)
    return Settings(**kw)


class Cluster:
    def __init__(self, controller: PDController, heartbeat: float):
        self.controller = controller
        self.pool = controller.pool
        self.heartbeat = heartbeat
        self.workers: dict[str, PDWorker] = {}
        self.runs: dict[str, asyncio.Task] = {}
        self._n = 0

    @property
    def address(self) -> str:
        return self.pool.address

    def engine(self, worker_id: str) -> fake.FakeEngine:
        return self.workers[worker_id].engine  # type: ignore[return-value]

    def engines(self) -> list[fake.FakeEngine]:
        return [w.engine for w in self.workers.values()]  # type: ignore[misc]

    def start(self, role: str, *, controllers: list[str] | None = None,
              worker_id: str | None = None, keys=None, heartbeat: float | None = None,
              **engine_kw) -> PDWorker:
        self._n += 1
        wid = worker_id or f"{role}-{self._n}"
        w = fake.fake_worker(Role[role.upper()], controllers or [self.address], worker_id=wid,
                             keys=keys, heartbeat_interval=heartbeat or self.heartbeat,
                             **engine_kw)
        self.workers[wid] = w
        self.runs[wid] = asyncio.create_task(w.run())
        return w

    async def add(self, role: str, n: int = 1, **kw) -> list[PDWorker]:
        """Start n workers of a role and wait until this controller has them ready."""
        new = [self.start(role, **kw) for _ in range(n)]
        await wait_until(lambda: all(self.has(w) for w in new), 10,
                         f"{n} {role} workers to register")
        return new

    def has(self, w: PDWorker) -> bool:
        """This controller has worker `w` ready: its own registration, not an earlier worker's
        entry under the same id."""
        return self.is_ready(w.worker_id) and any(
            link.registered and link.url == self.address for link in w.links.values())

    def is_ready(self, worker_id: str) -> bool:
        w = self.pool.registry.workers.get(worker_id)
        return w is not None and w.state.value == "ready"

    async def kill(self, worker_id: str) -> None:
        """Stop a worker and its engine without a word to the controller, as kill -9 does."""
        w = self.workers[worker_id]
        w._leave = lambda reason: None  # type: ignore[method-assign]  # no Unregister either
        w.stop()
        await asyncio.wait_for(self.runs[worker_id], 5)
        w.engine.shutdown()  # type: ignore[attr-defined]  # its KV goes with it

    async def run(self, prompt: list[int], params: SamplingParams | None = None,
                  request_id: str | None = None, timeout: float = 20.0) -> list:
        self._n += 1
        rid = request_id or f"req-{self._n}"

        async with asyncio.timeout(timeout):  # a cancel from the test always ends it
            return [o async for o in self.controller.generate(
                {"type": "token", "prompt_token_ids": prompt}, params or greedy(), rid)]

    def leaks(self) -> list[str]:
        out = []
        for wid, w in self.workers.items():
            e = w.engine
            if e.dead:  # type: ignore[attr-defined]
                continue
            if e.active_requests():  # type: ignore[attr-defined]
                out.append(f"{wid}: active {e.active_requests()}")  # type: ignore[attr-defined]
            if e.held_blocks():  # type: ignore[attr-defined]
                out.append(f"{wid}: {e.held_blocks()} held blocks")  # type: ignore[attr-defined]
            if w.tasks and not self.runs[wid].done():
                out.append(f"{wid}: worker tasks {list(w.tasks)}")
        if self.pool.legs:
            out.append(f"controller legs {list(self.pool.legs)}")
        queued = {w.id: w.queued_prefill_tokens for w in self.pool.registry.workers.values()
                  if w.queued_prefill_tokens}
        if queued:
            out.append(f"controller prefill queues {queued}")
        reserved = {w.id: w.reserved for w in self.pool.registry.workers.values() if w.reserved}
        if reserved:
            out.append(f"controller decode reservations {reserved}")
        if self.controller.active:
            out.append(f"controller requests {list(self.controller.active)}")
        return out

    async def assert_clean(self, timeout: float = 5.0) -> None:
        """Nothing stranded anywhere: no request on any engine, no held KV, no legs, no prefill
        counted as queued on a worker, no decode stream reserved on one."""
        try:
            await wait_until(lambda: not self.leaks(), timeout)
        except AssertionError:
            raise AssertionError("leaks: " + "; ".join(self.leaks())) from None

    async def stop_controller(self) -> None:
        """Stop the controller (its pool socket closes); the workers keep running."""
        if not self.controller.is_stopped:
            self.controller.shutdown()
        await self.pool.close()  # also after a test's own shutdown: a pool left open hangs GC

    async def close(self) -> None:
        for w in self.workers.values():
            w.stop()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)
        for w in self.workers.values():
            w.engine.shutdown()
        await self.stop_controller()


