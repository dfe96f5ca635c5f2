"""vLLM's own OpenAI server over an in-process fake engine: the baseline for the controller's
CPU per token (`pdserve bench overhead --part c`).

`InprocClient` is an EngineClient shaped like vLLM's AsyncLLM: each request's outputs come from
a `FakeEngine` (pdserve/fake.py, the engine the fake workers run, at the same `--decode-delay`)
in a producer task, go into vLLM's own `RequestOutputCollector` (which merges DELTA outputs when
the server falls behind, as AsyncLLM's output handler does), and `generate()` drains it as
AsyncLLM.generate does. So the server process pays what vLLM's front end pays per token (its
serving layer, the SSE chunks, the collector) plus the fake engine's own work, and nothing of
pdserve's controller. It runs on uvloop, as `vllm serve` does (and pdserve's controller).

    python -m pdserve.bench.inproc --model MODEL --port 8000 --decode-delay 0.01
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from http import HTTPStatus
from typing import Any

import uvloop
from vllm.engine.protocol import EngineClient
from vllm.exceptions import GracefulHTTPError
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.output_processor import RequestOutputCollector

from pdserve.fake import FakeEngine

logger = logging.getLogger("pdserve.bench.inproc")


class InprocClient(EngineClient):
    def __init__(self, vllm_config, engine: FakeEngine):
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.engine = engine
        self._producers: dict[str, asyncio.Task] = {}

    async def generate(self, prompt, sampling_params, request_id: str, **_: Any,
                       ) -> AsyncGenerator[Any, None]:
        token_ids = list(prompt["prompt_token_ids"])
        self.renderer.validate_token_ids(token_ids)
        kind = sampling_params.output_kind
        if kind == RequestOutputKind.CUMULATIVE:
            raise GracefulHTTPError("cumulative outputs are not served here",
                                    HTTPStatus.BAD_REQUEST)
        q = RequestOutputCollector(kind, request_id)
        task = asyncio.create_task(produce(self.engine, q, token_ids, sampling_params,
                                           request_id))
        self._producers[request_id] = task
        try:
            finished = False
            while not finished:
                out = q.get_nowait() or await q.get()  # as AsyncLLM.generate
                finished = out.finished
                yield out
        finally:
            task.cancel()
            self._producers.pop(request_id, None)

    async def abort(self, request_id: str | Iterable[str], **_: Any) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            task = self._producers.pop(rid, None)
            if task is not None:
                task.cancel()

    # ---- the rest of the protocol: nothing to do without a real engine ---------------------

    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError()

    def encode(self, *args, **kwargs):
        raise GracefulHTTPError("generation only", HTTPStatus.BAD_REQUEST)

    async def check_health(self) -> None:
        return None

    async def get_supported_tasks(self):
        return ("generate",)

    async def notify_kv_transfer_request_rejected(self, *args, **kwargs) -> None:
        return None

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def start_profile(self, *args, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def reset_mm_cache(self) -> None:
        return None

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(self, *args, **kwargs) -> bool:
        return False

    async def sleep(self, *args, **kwargs) -> None:
        return None

    async def release_kv_cache_memory(self) -> None:
        return None

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return True

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request) -> bool:
        return False

    async def pause_generation(self, *args, **kwargs) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        for task in self._producers.values():
            task.cancel()


async def produce(engine: FakeEngine, q: RequestOutputCollector, token_ids: list[int], params,
                  request_id: str) -> None:
    """Feed one request's outputs into its collector, as AsyncLLM's output handler does."""
    final = params.output_kind == RequestOutputKind.FINAL_ONLY
    whole = None
    try:
        async for ro in engine.generate(request_id, token_ids, params):
            if not final:
                q.put(ro)
            elif whole is None:
                whole = ro
            else:
                whole.add(ro, aggregate=True)
        if whole is not None:
            q.put(whole)
    except Exception as e:  # noqa: BLE001 - handed to the request's generate()
        q.put(e)


def engine_cost(concurrency: int, n: int, input_len: int, output_len: int,
                decode_delay: float) -> float:
    """CPU microseconds per token of the in-process engine and its collectors alone (no server):
    the share of InprocClient's server figure that is not vLLM's front end."""
    from vllm import SamplingParams

    async def run() -> int:
        engine = FakeEngine(decode_delay=decode_delay)
        slots = asyncio.Semaphore(concurrency)
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)

        async def one(i: int) -> int:
            async with slots:
                q = RequestOutputCollector(RequestOutputKind.DELTA, f"r{i}")
                task = asyncio.create_task(produce(engine, q, [1 + i % 500] * input_len, params,
                                                   f"r{i}"))
                tokens, finished = 0, False
                while not finished:
                    out = q.get_nowait() or await q.get()
                    finished = out.finished
                    tokens += len(out.outputs[0].token_ids)
                await task
                return tokens

        return sum(await asyncio.gather(*(one(i) for i in range(n))))

    t0 = time.process_time()
    tokens = asyncio.run(run())
    return round(1e6 * (time.process_time() - t0) / max(tokens, 1), 1)


async def serve(args) -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    from pdserve.controller.server import controller_config

    client = InprocClient(controller_config(args), FakeEngine(decode_delay=args.decode_delay))
    listen_address, sock = setup_server(args, reuse_port=False)
    tasks = await client.get_supported_tasks()
    app = build_app(args, tasks, client.model_config)
    await init_app_state(client, app.state, args, tasks)
    logger.info("vLLM's server over an in-process fake engine on %s", listen_address)
    try:
        shutdown_task = await serve_http(app, sock=sock, host=args.host, port=args.port,
                                         log_level=args.uvicorn_log_level,
                                         access_log=not args.disable_uvicorn_access_log)
        await shutdown_task
    finally:
        client.shutdown()
        sock.close()


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m pdserve.bench.inproc",
                                                    description=__doc__.split("\n")[0]))
    parser.add_argument("--decode-delay", type=float, default=0.0,
                        help="seconds between a request's tokens (the fake workers' flag)")
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    try:
        uvloop.run(serve(args))  # as `vllm serve`
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
