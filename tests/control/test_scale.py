"""Hundreds of workers with churn (joining, draining, dying) while requests run."""

from __future__ import annotations

import asyncio
import random

from fakepool import fast_settings, final_tokens, greedy, wait_until
from vllm.exceptions import GracefulHTTPError

from pdserve import fake
from pdserve.controller.registry import WorkerState
from pdserve.protocol import Role

PER_ROLE = 100
MIN_ALIVE = 20


async def test_200_workers_with_churn(make_cluster):
    rng = random.Random(2024)
    c = await make_cluster(heartbeat=0.5, missed=6,
                           settings=fast_settings(queue_timeout=5.0, max_retries=4))
    for role in ("prefill", "decode"):
        for _ in range(PER_ROLE):
            c.start(role, decode_delay=0.003)
    await wait_until(lambda: len(c.pool.registry.ready(Role.PREFILL)) == PER_ROLE
                     and len(c.pool.registry.ready(Role.DECODE)) == PER_ROLE, 30,
                     "200 workers to register")

    # Every leg must go to a worker that is ready at the moment it is sent.
    bad_sends: list[str] = []
    send = c.pool.send

    def checked_send(worker, msg, prefill_tokens=0):
        if worker.state != WorkerState.READY:
            bad_sends.append(f"{msg.request_id} -> {worker.id} ({worker.state.value})")
        return send(worker, msg, prefill_tokens)

    c.pool.send = checked_send  # type: ignore[method-assign]
    gone: dict[str, int] = {}  # worker id -> engine requests when it was killed or drained

    def alive(role: str) -> list[str]:
        return [wid for wid, w in c.workers.items() if wid.startswith(role)
                and not c.runs[wid].done() and wid not in gone]

    async def churn() -> None:
        drains = []
        for _ in range(40):
            await asyncio.sleep(0.1)
            role = rng.choice(["prefill", "decode"])
            action = rng.choice(["kill", "drain", "join"])
            victims = alive(role)
            if action == "join" or len(victims) <= MIN_ALIVE:
                c.start(role, decode_delay=0.003)
                continue
            wid = rng.choice(victims)
            if action == "kill":
                await c.kill(wid)  # a request it had already received may still start
                gone[wid] = len(c.engine(wid).served)
            else:
                gone[wid] = len(c.engine(wid).served)
                drains.append(asyncio.create_task(c.workers[wid].drain()))
        await asyncio.gather(*drains)

    results = {"completed": 0, "failed": 0}
    errors: list[str] = []

    async def client(k: int, stop: asyncio.Event) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            prompt = [k, i] * rng.randint(1, 40)
            try:
                outs = await c.run(prompt, greedy(8), f"c{k}-{i}", timeout=30)
            except GracefulHTTPError as e:
                results["failed"] += 1
                errors.append(str(e))
                continue
            assert final_tokens(outs) == fake.reference(prompt, greedy(8)).token_ids
            results["completed"] += 1

    stop = asyncio.Event()
    clients = [asyncio.create_task(client(k, stop)) for k in range(16)]
    await churn()
    stop.set()
    await asyncio.wait_for(asyncio.gather(*clients), 60)  # none hangs

    assert results["completed"] > 200, results
    assert results["failed"] <= results["completed"] // 20, (results, errors[:5])
    assert all(e for e in errors)  # every failure says why
    assert bad_sends == []
    for wid, served in gone.items():
        if c.workers[wid].draining:  # finishes what it had (bad_sends: got nothing new)
            await asyncio.wait_for(c.runs[wid], 30)
        else:
            assert len(c.engine(wid).served) == served, wid
    await wait_until(lambda: all(c.pool.registry.workers[w].state == WorkerState.DEAD
                                 for w in gone if w in c.pool.registry.workers), 10,
                     "killed workers to be dead and drained ones gone")
    await c.assert_clean(10)
