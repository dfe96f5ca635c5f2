"""`pdserve bench join`: how fast a running pool takes in a new controller, and lets one go.

In one process: a controller over `--workers` fake workers (half prefill, half decode) that find
their controllers in a file they re-read every heartbeat interval (worker/discovery.py). A
second controller starts and is added to the file: the time until it has every worker ready,
and until it has served its first request, in seconds and in heartbeat intervals (the issue's
target: its first request within 2 intervals). Then it is removed from the file: the time until
every worker has left it. Real sockets, real registries; the engines are pdserve.fake.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve import fake
from pdserve.protocol import Role

TARGET_INTERVALS = 2.0


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench join", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=50)
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--out", default=None, help="also write the figures here as JSON")
    return p


async def _until(pred, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("gave up waiting")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


def _controller(vllm_config, hb: float):
    from pdserve.controller.client import PDController
    from pdserve.controller.pool import Pool
    from pdserve.controller.sequence import Settings

    pool = Pool("tcp://127.0.0.1:0", expected=fake.fake_info(), heartbeat_interval=hb)
    pool.start()
    return PDController(vllm_config, pool, Settings(queue_timeout=0.0))


def _ready(c) -> int:
    reg = c.pool.registry
    return len(reg.ready(Role.PREFILL)) + len(reg.ready(Role.DECODE))


async def _first_request(c) -> None:
    """Retry a one-token request until the controller serves it."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=1, temperature=0.0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prompt = {"type": "token", "prompt_token_ids": list(range(100, 140))}
    while True:
        try:
            c.check_admission()
            async for _ in c.generate(prompt, params, f"join-{time.monotonic_ns()}"):
                pass
            return
        except Exception:  # noqa: BLE001 - no worker yet: 503; try again at once
            await asyncio.sleep(0.005)


async def run(n: int, hb: float) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from pdserve.models import ensure_model
    from pdserve.worker.discovery import Discovery

    vllm_config = AsyncEngineArgs(model=str(ensure_model("tiny")), dtype="float32",
                                  enforce_eager=True).create_engine_config()
    a = _controller(vllm_config, hb)
    listing = Path(tempfile.mkdtemp(prefix="pdserve-join-")) / "controllers"
    listing.write_text(a.pool.address + "\n")
    workers = [fake.fake_worker(Role.PREFILL if i % 2 else Role.DECODE,
                                Discovery(files=[listing]), heartbeat_interval=hb,
                                worker_id=f"w{i}", info=fake.fake_info())
               for i in range(n)]
    runs = [asyncio.create_task(w.run()) for w in workers]
    b = None
    try:
        await _until(lambda: _ready(a) == n, 60)
        b = _controller(vllm_config, hb)
        t0 = time.monotonic()
        listing.write_text(f"{a.pool.address}\n{b.pool.address}\n")
        await _first_request(b)
        first = time.monotonic() - t0
        everyone = first + await _until(lambda: _ready(b) == n, 60)
        t1 = time.monotonic()
        listing.write_text(a.pool.address + "\n")
        await _until(lambda: not b.pool.registry.workers, 60)
        left = time.monotonic() - t1
    finally:
        for w in workers:
            w.stop()
        await asyncio.gather(*runs, return_exceptions=True)
        for c in (a, b):
            if c is not None:
                c.shutdown()
                await c.pool.close()
    return {"workers": n, "heartbeat_interval_s": hb,
            "first_request_s": round(first, 3), "first_request_intervals": round(first / hb, 2),
            "all_registered_s": round(everyone, 3),
            "all_left_s": round(left, 3), "all_left_intervals": round(left / hb, 2),
            "target_intervals": TARGET_INTERVALS}


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    res = asyncio.run(run(args.workers, args.heartbeat_interval))
    print(f"{res['workers']} fake workers, heartbeat every {res['heartbeat_interval_s']:g} s:")
    print(f"  new controller's first request served after {res['first_request_s']:.3f} s "
          f"({res['first_request_intervals']:.2f} intervals; target <= {TARGET_INTERVALS:g})")
    print(f"  all workers registered with it after {res['all_registered_s']:.3f} s")
    print(f"  removed from the set: every worker left it after {res['all_left_s']:.3f} s "
          f"({res['all_left_intervals']:.2f} intervals)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0
