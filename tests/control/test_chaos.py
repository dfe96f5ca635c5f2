"""Chaos: steady load while fake workers in their own processes are killed with SIGKILL and
restarted. One prefill and one decode worker stay alive throughout, so no request may fail."""

from __future__ import annotations

import asyncio
import os
import random
import sys

from fakepool import fast_settings, final_tokens, greedy, wait_until
from vllm.exceptions import GracefulHTTPError

from pdserve import fake


async def test_kill_9_and_restart_under_load(make_cluster, tmp_path):
    rng = random.Random(99)
    c = await make_cluster(heartbeat=0.2, missed=5, settings=fast_settings(
        queue_timeout=10.0, prefill_timeout=15.0, token_timeout=10.0, max_retries=4))
    await c.add("prefill")
    await c.add("decode", decode_delay=0.005)
    procs: dict[str, asyncio.subprocess.Process] = {}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    async def spawn(role: str, wid: str) -> None:
        with open(tmp_path / f"{wid}.log", "ab") as log:  # noqa: ASYNC230
            procs[wid] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pdserve.fake", "worker", "--role", role,
                "--controller", c.address, "--worker-id", wid, "--decode-delay", "0.01",
                "--heartbeat-interval", "0.2", stdout=log, stderr=log, env=env)
        # A subprocess worker imports vLLM (~10 s, far longer on a loaded machine).
        await wait_until(lambda: c.is_ready(wid), 300, f"{wid} to register")

    counts = {"sent": 0, "completed": 0, "failed": 0, "wrong": 0}

    async def client(k: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            counts["sent"] += 1
            prompt = [k, counts["sent"]] * rng.randint(1, 30)
            try:
                outs = await c.run(prompt, greedy(16), timeout=60)
            except GracefulHTTPError:
                counts["failed"] += 1
                continue
            ok = final_tokens(outs) == fake.reference(prompt, greedy(16)).token_ids
            counts["completed" if ok else "wrong"] += 1

    try:
        await asyncio.gather(spawn("prefill", "px"), spawn("decode", "dx"))
        stop = asyncio.Event()
        clients = [asyncio.create_task(client(k, stop)) for k in range(6)]
        for victim, role in [("dx", "decode"), ("px", "prefill"), ("dx", "decode")]:
            await asyncio.sleep(0.5)
            procs[victim].kill()  # SIGKILL, mid-stream
            await procs[victim].wait()
            await spawn(role, victim)  # the same id: it replaces its dead entry
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 90)  # nothing hangs
    finally:
        for p in procs.values():
            if p.returncode is None:
                p.kill()
                await p.wait()

    lost = counts["sent"] - counts["completed"] - counts["failed"] - counts["wrong"]
    assert lost == 0 and counts["wrong"] == 0 and counts["failed"] == 0, counts
    assert counts["completed"] > 20, counts
    assert not c.controller.active and not c.pool.legs
