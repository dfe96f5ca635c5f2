"""PDController: vLLM's EngineClient, backed by a pool of prefill and decode workers.

vLLM's OpenAI server renders and validates each request with this client's renderer and
input_processor (built from the model folder, as a plain engine would), then calls generate().
generate() runs one `Sequence` per requested completion (n) and turns their output into
RequestOutputs of the kind the server asked for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from http import HTTPStatus
from typing import Any

from vllm.engine.protocol import EngineClient
from vllm.exceptions import GracefulHTTPError
from vllm.v1.engine.exceptions import EngineDeadError

from pdserve.controller.admission import Admission, Slots, Ticket
from pdserve.controller.metrics import Metrics
from pdserve.controller.pool import Pool
from pdserve.controller.router import make_policy
from pdserve.controller.sequence import Placer, Sequence, Settings, State
from pdserve.controller.stream import Stream
from pdserve.errors import NoWorkerReady, Refused, ShuttingDown
from pdserve.protocol import Role

logger = logging.getLogger(__name__)


class PDController(EngineClient):
    def __init__(self, vllm_config, pool: Pool, settings: Settings | None = None,
                 metrics: Metrics | None = None):
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.pool = pool
        self.settings = settings or Settings()
        block_size = vllm_config.cache_config.block_size
        self.prefill_policy = make_policy(self.settings.prefill_policy, block_size, "prefill")
        self.decode_policy = make_policy(self.settings.decode_policy, block_size, "decode")
        self.metrics = metrics or Metrics()
        self.admission = Admission(self.settings.max_inflight, self.settings.max_queued,
                                   self.settings.queue_timeout, slots=self._serving_slots)
        pool.watch(lambda _event, _worker: self.admission.refresh())
        # Whether the pool had a worker of each role at the last change (absent: not yet one),
        # for the log of the fallback's start and end.
        self._had: dict[Role, bool] = {}
        pool.watch(lambda _event, _worker: self._log_sides())
        self.metrics.watch_admission(self.admission)
        self.active: dict[str, list[Sequence]] = {}
        # With placement "slo": the controller's Planning (server.py), which places requests.
        self.placer: Placer | None = None
        self._closing = False  # shutting down: new requests are refused, streams finish
        # Called on the event loop as the shutdown begins: the server stops accepting
        # connections, so new ones go to the other API servers on the port (server.py).
        self.on_closing: Callable[[], None] = lambda: None
        self._stopped = False

    # ---- generation ------------------------------------------------------------------------

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        # Runs before a streaming response starts, so a missing role is a real HTTP 503
        # rather than an error event inside a 200 stream.
        if self._closing:
            self.metrics.rejected("shutting_down")
            raise ShuttingDown()
        # A suspect worker may be back in a moment: the request waits for it (queue timeout).
        missing = self._missing_role(suspect=True)
        if missing is not None:
            self.metrics.rejected_no_worker(missing.label)
            raise NoWorkerReady(missing)
        # Likewise a full admission queue is a real 429 (with Retry-After, see server.py).
        try:
            self.admission.check(n)
        except Refused as e:
            self.metrics.rejected(e.reason)
            raise

    def _missing_role(self, suspect: bool) -> Role | None:
        """The role whose absence stops the pool from serving (None: it can serve). With the
        fallback a worker of either role can serve a request whole; with local prefill
        on (or placement by the SLO, which then serves every request local), decode workers
        alone can."""
        def has(side: Role) -> bool:
            return bool(self.pool.registry.ready(side, suspect=suspect))

        s = self.settings
        if s.fallback:
            return None if has(Role.DECODE) or has(Role.PREFILL) else Role.DECODE
        needed = ((Role.DECODE,) if s.local_prefill_threshold or self.placer
                  else (Role.PREFILL, Role.DECODE))
        return next((side for side in needed if not has(side)), None)

    def _log_sides(self) -> None:
        """Say when the pool loses its last worker of a role, and when one is back: in between,
        the workers of the other role serve requests whole (or requests wait for one)."""
        for side, other in ((Role.PREFILL, Role.DECODE), (Role.DECODE, Role.PREFILL)):
            has = bool(self.pool.registry.ready(side, suspect=True))
            had = self._had.get(side)
            if has == bool(had):  # no change (a pool still starting has had none)
                continue
            self._had[side] = has
            others = bool(self.pool.registry.ready(other, suspect=True))
            if has:
                if had is False:
                    logger.info("a %s worker is ready again: %s", side.label,
                                "requests are disaggregated again" if others else
                                f"it serves new requests whole until a {other.label} worker is")
            elif not others:  # both gone: a whole pool draining, as serve stops
                logger.warning("no %s worker is left, nor a %s worker: new requests are "
                               "refused (503) until one is ready", side.label, other.label)
            elif self.settings.fallback:
                logger.warning("no %s worker is left: %s workers serve new requests whole "
                               "until one is ready (seeded ones wait for it)", side.label,
                               other.label)
            else:
                logger.warning("no %s worker is left: new requests wait for one, up to "
                               "--queue-timeout", side.label)

    def _serving_slots(self) -> Slots | None:
        """Streams the engines that decode run at once, and those other controllers do not
        hold: the ready decode workers', or, while none is left and the prefill workers serve
        requests whole (the fallback), theirs. None: unknown, or no worker can serve, whose
        wait `Sequence` times and names."""
        registry = self.pool.registry
        workers = registry.ready(Role.DECODE)
        if not workers and self.settings.fallback and not registry.ready(Role.DECODE,
                                                                         suspect=True):
            workers = registry.ready(Role.PREFILL)
        if not workers or not all(w.max_seqs for w in workers):
            return None
        return Slots(sum(w.free_slots() for w in workers), sum(w.max_seqs for w in workers))

    async def generate(self, prompt, sampling_params, request_id: str, *,
                       prompt_text: str | None = None, **kwargs: Any,
                       ) -> AsyncGenerator[Any, None]:
        if self._closing:  # it passed check_admission before the shutdown began
            raise ShuttingDown()
        token_ids = _prompt_token_ids(prompt)
        # What a plain engine's input processor checks here: no worker can serve such ids.
        self.renderer.validate_token_ids(token_ids)
        if prompt_text is None and isinstance(prompt, dict):
            prompt_text = prompt.get("prompt")
        params = sampling_params
        n = params.n or 1
        stream = Stream(request_id, prompt_text, token_ids, params.output_kind, n,
                        want_logprobs=params.logprobs is not None)
        timeline = self.metrics.timeline(len(token_ids))
        # Nothing from here to the `try` below awaits: a cancellation cannot skip its release.
        ticket = await self._admit(n, timeline)
        seqs = [Sequence(self.pool, self.prefill_policy, self.decode_policy, self.settings,
                         request_id, token_ids, _child_params(params, i, n), stream, i,
                         observer=timeline, placer=self.placer)
                for i in range(n)]
        self.active.setdefault(request_id, []).extend(seqs)
        outcome = "aborted"
        try:
            async for _ in _merge_runs([s.run() for s in seqs]):
                out = stream.emit()
                if out is not None:
                    yield out
            aborted = any(s.state == State.ABORTED for s in seqs)
            outcome = "aborted" if aborted else "completed"
        except GracefulHTTPError:
            outcome = "failed"
            raise
        except ValueError:
            outcome = "rejected"
            raise
        finally:
            self.admission.release(ticket)
            for s in seqs:
                s.abort()
            rest = [s for s in self.active.get(request_id, ()) if s not in seqs]
            if rest:
                self.active[request_id] = rest
            else:
                self.active.pop(request_id, None)
            timeline.finish(outcome)

    async def _admit(self, n: int, timeline) -> Ticket:
        """Slots for n sequences, waiting in line for them if need be."""
        try:
            return await self.admission.acquire(n)
        except GracefulHTTPError as e:
            if isinstance(e, Refused):
                self.metrics.rejected(e.reason)
            timeline.finish("rejected")
            raise
        except BaseException:
            timeline.finish("aborted")  # cancelled while waiting: the client went away
            raise

    async def abort(self, request_id: str | Iterable[str], **_: Any) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for s in self.active.get(rid, ()):
                s.abort()

    # ---- health and the rest of the protocol -----------------------------------------------

    @property
    def is_running(self) -> bool:
        return not self._stopped

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def errored(self) -> bool:
        return False  # workers fail, the controller does not: it routes around them

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError()

    async def check_health(self) -> None:
        if self._closing:  # load balancers and readiness probes stop sending here
            raise EngineDeadError()
        missing = self._missing_role(suspect=False)
        if missing is not None:
            logger.warning("health: no ready %s worker", missing.label)
            raise EngineDeadError()

    async def get_supported_tasks(self):
        return ("generate",)

    async def notify_kv_transfer_request_rejected(self, request_id, kv_transfer_params, *,
                                                  data_parallel_rank=None) -> None:
        # Clients' kv_transfer_params are never used by pdserve (see sequence.leg_params), so
        # nothing was pinned on their behalf.
        return None

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        counts = self.pool.registry.counts()
        logger.info("pool: %s; %d requests in flight",
                    ", ".join(f"{r}/{s}={c}" for (r, s), c in sorted(counts.items())) or "empty",
                    len(self.active))

    def encode(self, *args, **kwargs):
        raise GracefulHTTPError("pdserve serves generation only; pooling models are not "
                                "supported", HTTPStatus.BAD_REQUEST)

    async def start_profile(self, *args, **kwargs) -> None:
        raise GracefulHTTPError("profiling runs on the workers' engines, not the controller",
                                HTTPStatus.BAD_REQUEST)

    async def stop_profile(self) -> None:
        await self.start_profile()

    async def reset_mm_cache(self) -> None:
        return None  # text-only: there is no multi-modal cache

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_connector: bool = False) -> bool:
        return False  # the caches live in the workers' engines

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        raise GracefulHTTPError("sleep mode is not supported by pdserve", HTTPStatus.BAD_REQUEST)

    async def release_kv_cache_memory(self) -> None:
        await self.sleep()

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return True

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request) -> bool:
        raise GracefulHTTPError("LoRA adapters are not supported by pdserve",
                                HTTPStatus.BAD_REQUEST)

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        raise GracefulHTTPError("pausing is done per worker (SIGTERM drains a worker)",
                                HTTPStatus.BAD_REQUEST)

    async def scale_elastic_ep(self, new_data_parallel_size: int,
                               drain_timeout: int = 300) -> None:
        # vLLM's /scale_elastic_ep answers a ValueError with a 400 carrying its text.
        raise ValueError("pdserve scales by workers, not data-parallel ranks: start a `pdserve "
                         "worker --role prefill|decode --controller ...` to add one, send one "
                         "SIGTERM to drain it")

    async def resume_generation(self) -> None:
        return None

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop: new requests get 503 at once (and /health fails, so balancers and readiness
        probes turn away), the streams in flight have `timeout` seconds to finish (vLLM's
        --shutdown-timeout; vLLM's server calls this on SIGTERM or SIGINT), the rest are
        aborted."""
        # vLLM calls this from a worker thread; the pool's sockets belong to the event loop.
        self._closing = True
        loop = self.pool.loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or loop.is_closed() or here is loop:
            self._stopped = True
            self._abort_all()
            return
        loop.call_soon_threadsafe(self.on_closing)
        if timeout:
            done = asyncio.run_coroutine_threadsafe(self._finish_streams(timeout), loop)
            try:
                done.result(timeout + 5)
            except Exception:  # noqa: BLE001 - stopping anyway
                logger.exception("waiting for the streams in flight failed")
        self._stopped = True
        loop.call_soon_threadsafe(self._abort_all)

    async def _finish_streams(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self.active:
            logger.info("shutting down: refusing new requests; waiting up to %g s for the %d "
                        "requests in flight", timeout, len(self.active))
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            logger.warning("shutting down: aborting the %d requests still in flight after %g s",
                           len(self.active), timeout)

    def _abort_all(self) -> None:
        for seqs in list(self.active.values()):
            for s in seqs:
                try:
                    s.abort()
                except Exception:  # shutting down: log, and free the rest
                    logger.exception("abort during shutdown failed")


def _prompt_token_ids(prompt) -> list[int]:
    if isinstance(prompt, dict) and prompt.get("prompt_token_ids") is not None:
        return list(prompt["prompt_token_ids"])
    raise GracefulHTTPError("pdserve takes token prompts (as vLLM's server renders them); "
                            f"got {type(prompt).__name__}", HTTPStatus.BAD_REQUEST)


def _child_params(params, index: int, n: int):
    """Sampling parameters of completion `index` of `n`, seeded as vLLM seeds its children."""
    if n == 1:
        return params
    child = params.clone()
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    return child


def _merge_runs(runs: list[AsyncIterator[None]]) -> AsyncIterator[None]:
    """Interleave several sequences' progress; the first error cancels the rest."""
    return runs[0] if len(runs) == 1 else _interleave(runs)


async def _interleave(runs: list[AsyncIterator[None]]) -> AsyncIterator[None]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(run):
        try:
            async for _ in run:
                await queue.put(None)
            await queue.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer below
            await queue.put(e)

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
