"""vLLM's own way from `AsyncLLM.generate` to its engine queuing the request, on an idle engine.

A decode worker's `worker_in` phase (controller/phases.py) is pdserve's part (the Generate
message in, its sampling parameters, the leg's task) plus this: vLLM's input processing, the
request's way to the engine core's process and the engine core taking it in. This measures the
second part alone, with the prompt passed as the worker passes it (already tokenized, so vLLM
takes its synchronous path), one request at a time on an engine with nothing else to do.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1 \\
        .venv/bin/python scripts/engine_queue_cost.py [--model DIR] [--prompt 300] [--requests 40]

Prints medians in ms: `process_inputs`, the call until the request is handed to the socket to
the engine core's process, and from there until the engine core queued it (the engine core's
clock is this host's monotonic clock).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WARMUP = 5  # the first requests pay for the engine's first steps


async def measure(model: str, prompt_len: int, requests: int) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    # The one-process executor, as pdserve's CPU workers run their engines (worker/engine.py).
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, distributed_executor_backend="uni", disable_log_stats=False))
    processing: list[float] = []
    handed: list[float] = []  # when the request was handed to the socket to the engine core
    process_inputs = llm.input_processor.process_inputs
    add_request_async = llm.engine_core.add_request_async

    def timed_process_inputs(*args, **kwargs):
        start = time.monotonic()
        request = process_inputs(*args, **kwargs)
        processing.append(time.monotonic() - start)
        return request

    async def timed_add_request_async(request):
        handed.append(time.monotonic())
        return await add_request_async(request)

    llm.input_processor.process_inputs = timed_process_inputs  # type: ignore[method-assign]
    llm.engine_core.add_request_async = timed_add_request_async  # type: ignore[method-assign]
    rng = random.Random(1)
    to_hand, to_queue = [], []
    try:
        for i in range(requests):
            prompt = {"type": "token",
                      "prompt_token_ids": [rng.randrange(100, 1000) for _ in range(prompt_len)]}
            params = SamplingParams(max_tokens=2, temperature=0,
                                    output_kind=RequestOutputKind.DELTA)
            called = time.monotonic()
            queued = None
            async for out in llm.generate(prompt, params, request_id=f"q{i}"):
                if queued is None and out.metrics is not None:
                    queued = out.metrics.queued_ts
            if queued is not None:
                to_hand.append(handed[-1] - called)
                to_queue.append(queued - handed[-1])
            await asyncio.sleep(0.05)  # idle again, as between sequential requests
    finally:
        llm.shutdown()
        del llm  # else its __del__ shuts it down again as the interpreter exits, and fails

    def ms(xs: list[float]) -> float:
        return statistics.median(xs[WARMUP:]) * 1e3

    return {"process_inputs": ms(processing), "call -> handed to the socket": ms(to_hand),
            "handed -> queued": ms(to_queue),
            "call -> queued": ms([a + b for a, b in zip(to_hand, to_queue)])}


def main() -> None:
    from pdserve.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny preset)")
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens")
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args()
    model = resolve_model(args.model)
    # vLLM leaves its sockets where it makes them, even after a clean shutdown: in a folder of
    # this run's, unless the user placed them.
    with tempfile.TemporaryDirectory(prefix="pdserve-queue-") as sockets:
        os.environ.setdefault("VLLM_RPC_BASE_PATH", sockets)
        figures = asyncio.run(measure(model, args.prompt, args.requests))
    print(f"{args.requests - WARMUP} requests of {args.prompt} prompt tokens, medians (ms): "
          + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
