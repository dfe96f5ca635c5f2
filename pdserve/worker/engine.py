"""How a worker's vLLM engine is configured for its role, and the engine seam the worker uses.

`Engine` is what PDWorker needs from an engine; `VllmEngine` implements it around AsyncLLM and
`pdserve.fake.FakeEngine` implements it in-process for control-plane tests.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from pdserve import procfs, protocol
from pdserve.protocol import EngineInfo, Load, Role
from pdserve.worker.kv_events import KvEventSource, ZmqKvEvents, endpoints, events_config
from pdserve.worker.stop_signals import ENGINE_OWN_GROUP_ENV

KV_ROLES = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer", Role.BOTH: "kv_both",
            Role.AUTO: "kv_both"}
CPU_CONNECTOR = "PDCpuNixlConnector"
CPU_CONNECTOR_MODULE = "pdserve.kv.cpu_nixl"
# SamplingParams.extra_args key naming the tokens a leg must draw first (worker/first_token.py)
FORCED_TOKENS_ARG = "pdserve_forced_tokens"
FORCED_TOKENS_PROCESSOR = "pdserve.worker.first_token:ForcedTokensProcessor"
# vLLM's one-process executor, named so that vLLM CPU keeps it (see executor_backend).
IN_ENGINE_CORE_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


class Engine(Protocol):
    info: EngineInfo
    kv_events: KvEventSource | None  # its prefix cache's KV events, if it publishes them
    kv_blocks: int  # KV cache blocks (0: unknown)
    kv_block_bytes: int  # bytes of one block's KV across all layers (what a handoff moves)
    max_seqs: int  # requests it runs at once (0: unknown)

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                 ) -> AsyncIterator[Any]:
        """Stream vLLM RequestOutputs (DELTA kind) for one request."""
        ...

    async def abort(self, request_ids: list[str]) -> None: ...

    async def release(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        """Free KV blocks a prefill worker holds for a decode that will never run."""
        ...

    async def release_held(self, request_ids: list[str]) -> None:
        """Free the blocks this engine holds for these prefills' decodes, if they finished:
        their ends never left this worker (aborted meanwhile), so no decode will read them.
        After abort(): a prefill still running then is freed by it."""
        ...

    def load(self) -> Load: ...

    def unanswered(self) -> float:
        """Seconds the engine has shown no sign that it steps (0 while it does: EngineProbe)."""
        ...

    async def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class EngineProbe:
    """Whether an engine still steps, seen from its worker: a question it answers between two
    steps, one out at a time, asked again once answered. vLLM's health check only says whether
    the engine core died; one that stopped (SIGSTOP, a paused container, a hang) passes it.

    A long step leaves the question out too (a big model's prefill chunk on a CPU can take
    longer than the worker's patience), so with `cpu` (the engine's processes' CPU seconds) an
    engine that keeps a share of a core busy (BUSY_SHARE) counts as stepping: a stopped or
    deadlocked one uses next to none."""

    def __init__(self, ask: Callable[[], Awaitable[Any]],
                 clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] | None = None):
        self.ask = ask
        self.clock = clock
        self.cpu = cpu
        self._out: asyncio.Future | None = None
        self._since = 0.0  # when it last showed that it steps
        self._seen: tuple[float, float] | None = None  # (when, its CPU seconds then)

    def unanswered(self) -> float:
        """Seconds since the engine last answered, or kept its cores busy, while a question was
        out (0 when there was none out: one is asked now). Never cancelled: a late answer is
        only late."""
        now = self.clock()
        if self._out is not None and not self._out.done():
            if self._busy(now):
                self._since = now
            return now - self._since
        self._out, self._since, self._seen = asyncio.ensure_future(self.ask()), now, None
        self._out.add_done_callback(_retrieve)
        return 0.0

    def _busy(self, now: float) -> bool:
        """Whether the engine used at least BUSY_SHARE of a core since the last look while the
        question was out (the first such look only notes its CPU time). Not read while the
        engine answers, as it does within a step: a look costs ~1.5 ms of the worker's loop."""
        if self.cpu is None:
            return False
        seen, self._seen = self._seen, (now, self.cpu())
        if seen is None:
            return False
        return self._seen[1] - seen[1] >= BUSY_SHARE * (now - seen[0])


# An engine using this share of a core is computing (a step uses a whole one); a stopped one
# uses none, and an idle or deadlocked one a percent or two (NIXL's progress thread, polling).
BUSY_SHARE = 0.1


def _retrieve(answer: asyncio.Future) -> None:
    # A dead engine's error is the health check's to report; this only marks it seen.
    if not answer.cancelled():
        answer.exception()


@dataclass
class EngineSettings:
    """What pdserve decides about a worker's engine; the rest are vLLM's own engine args."""

    role: Role
    advertise_host: str = "127.0.0.1"
    kv_port: int = 5600
    cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0-3"
    kv_cache_gib: int = 1  # CPU only (VLLM_CPU_KVCACHE_SPACE takes whole GiB)
    kv_events: bool = True  # publish prefix-cache events for the controllers' KV index


def is_cpu_host() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def kv_transfer_config(role: Role, cpu: bool) -> dict[str, Any]:
    if cpu:
        return {"kv_connector": CPU_CONNECTOR, "kv_connector_module_path": CPU_CONNECTOR_MODULE,
                "kv_role": KV_ROLES[role], "kv_buffer_device": "cpu"}
    return {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[role]}


def engine_env(s: EngineSettings, cpu: bool) -> dict[str, str]:
    """Environment the engine-core process reads at start (it is spawned after this is set)."""
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": s.advertise_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(s.kv_port),
        # The worker's pid: its engine core, and only it, moves to a group of its own.
        ENGINE_OWN_GROUP_ENV: str(os.getpid()),
    }
    # UCX picks its transport and interface itself unless told. On a CPU host: engines on one
    # host read each other's blocks with cross-memory attach (cma: one process_vm_readv, the
    # holder idle); engines on other hosts over TCP. UCX offers cma only to a peer in its own pid
    # namespace on the same machine, and only where the kernel lets it (it checks ptrace_scope).
    if "UCX_TLS" not in os.environ and cpu:
        env["UCX_TLS"] = "cma,tcp"
    if "UCX_NET_DEVICES" not in os.environ and s.advertise_host.startswith("127."):
        env["UCX_NET_DEVICES"] = "lo"
    # UCX over TCP has no remote read: the prefill engine sends a read's blocks back as
    # messages of UCX_TCP_TX_SEG_SIZE, 8 KB by default, one system call each on both sides
    # (~1,000 for a 2,000-token prompt of the bench preset). 32 KB quarters that, and still fits
    # a reader's receive segments at their default (64 KB), so peers started without it read.
    if "UCX_TCP_TX_SEG_SIZE" not in os.environ and cpu:
        env["UCX_TCP_TX_SEG_SIZE"] = "32k"
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                       str(s.kv_cache_gib))
        if s.cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = s.cores
    return env


def parse_cores(spec: str) -> set[int]:
    """CPU ids from a list like "0", "0-3" or "0,2-3" (the VLLM_CPU_OMP_THREADS_BIND form)."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"bad core list {spec!r}: want e.g. 0, 0-3 or 0,2-3") from None
        if first < 0 or last < first:
            raise ValueError(f"bad core range {part.strip()!r} in {spec!r}")
        out.update(range(first, last + 1))
    return out


def keep_to_cores(cpus: set[int]) -> None:
    """Keep every thread of this process to `cpus`, those imports (torch, vLLM) already started
    too: a thread keeps its own mask, and new threads and child processes inherit their
    creator's. ValueError if `cpus` holds none this process may use."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # ended meanwhile
        except OSError as e:
            raise ValueError(f"none of CPUs {cpu_list(cpus)} is one this process may use "
                             f"(it may use {cpu_list(os.sched_getaffinity(0))})") from e


def cpu_list(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def resolve_dtype(dtype: str, cpu: bool) -> str:
    # On CPU, vLLM's "auto" turns float32 checkpoints into bfloat16, whose kernels died with
    # SIGILL on the virtual machines here (AMX advertised, not usable): stay in float32.
    return "float32" if cpu and dtype == "auto" else dtype


def configure(args, s: EngineSettings, cpu: bool):
    """Set what P/D needs on vLLM's AsyncEngineArgs `args` (in place) and return them."""
    args.kv_transfer_config = kv_transfer_config(s.role, cpu)
    args.dtype = resolve_dtype(args.dtype, cpu)
    args.distributed_executor_backend = executor_backend(args, cpu)
    args.enable_prefix_caching = True
    if s.kv_events and not _events_on(args):
        from vllm.config.kv_events import KVEventsConfig

        args.kv_events_config = KVEventsConfig(**events_config(*endpoints(str(os.getpid()))))
    if FORCED_TOKENS_PROCESSOR not in (args.logits_processors or []):
        args.logits_processors = [*(args.logits_processors or []), FORCED_TOKENS_PROCESSOR]
    args.disable_log_stats = False  # the stats feed the worker's heartbeat load
    return args


def executor_backend(args, cpu: bool):
    """The executor for an engine: on CPU one engine on one device runs its model inside its
    engine core unless the user chose otherwise. vLLM CPU turns "uni" into its "mp" executor
    (the caller's process may hold OpenMP already; AsyncLLM's engine core is a fresh process),
    which adds a model-runner process on the same core, the two busy-polling each other's
    queues (measured at 2 req/s: prefill core 87% busy against 24%, TPOT p50 14-27% higher).
    Named by class, the same executor passes that check."""
    chosen = args.distributed_executor_backend
    one_device = args.tensor_parallel_size * args.pipeline_parallel_size == 1
    if cpu and one_device and chosen in (None, "uni"):
        return IN_ENGINE_CORE_EXECUTOR
    return chosen


def _events_on(args) -> bool:
    cfg = getattr(args, "kv_events_config", None)
    return bool(cfg and cfg.enable_kv_cache_events)


def event_source(args) -> KvEventSource | None:
    """A reader of the events the engine publishes (the user's --kv-events-config, if given
    with a replay endpoint, else pdserve's own); None when events are off."""
    cfg = getattr(args, "kv_events_config", None)
    if not (cfg and cfg.enable_kv_cache_events and cfg.publisher == "zmq"
            and cfg.replay_endpoint):
        return None
    local = "tcp://127.0.0.1:"
    return ZmqKvEvents(cfg.endpoint.replace("tcp://*:", local),
                       cfg.replay_endpoint.replace("tcp://*:", local))


def block_bytes(vllm_config) -> int:
    """Bytes of KV one block holds across all layers (keys and values)."""
    import torch

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    itemsize = torch.empty((), dtype=mc.dtype).element_size()
    return (2 * mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size()
            * vllm_config.cache_config.block_size * itemsize)


def decode_params(raw: bytes) -> Any:
    """vLLM SamplingParams from their wire form (msgspec, as the controller encodes them)."""
    from vllm import SamplingParams

    params = msgspec.msgpack.decode(raw, type=SamplingParams)
    # Decoded afresh for one leg, which alone uses them: vLLM's input processing may take them
    # as they are instead of deep-copying them (61-172 us for a decode leg's block list).
    params.skip_clone = True
    return params


def engine_info(vllm_config) -> EngineInfo:
    mc = vllm_config.model_config
    ktc = vllm_config.kv_transfer_config
    return EngineInfo(
        model=os.path.basename(os.path.normpath(mc.model)),
        tokenizer=os.path.basename(os.path.normpath(mc.tokenizer)),
        block_size=vllm_config.cache_config.block_size,
        dtype=str(mc.dtype).removeprefix("torch."),
        kv_connector=_connector_family(ktc.kv_connector if ktc else None),
        max_model_len=mc.max_model_len,
    )


def expected_info(vllm_config) -> EngineInfo:
    """What a controller on `vllm_config` (which has no connector) admits: workers on the
    same model and settings, with a NIXL-family connector."""
    return msgspec.structs.replace(engine_info(vllm_config), kv_connector="nixl")


def _connector_family(name: str | None) -> str:
    # The CPU variant moves the same bytes the same way as NixlConnector: they interoperate.
    return "nixl" if name in ("NixlConnector", CPU_CONNECTOR) else (name or "none")


class VllmEngine:
    """A vLLM AsyncLLM configured for one P/D role."""

    def __init__(self, settings: EngineSettings, args):
        from vllm.v1.engine.async_llm import AsyncLLM

        cpu = is_cpu_host()
        os.environ.update(engine_env(settings, cpu))
        self._stats = _LoadRecorder()
        configure(args, settings, cpu)
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.factory])
        self.info = engine_info(self.llm.vllm_config)
        self.vllm_config = self.llm.vllm_config
        self.kv_blocks = self.vllm_config.cache_config.num_gpu_blocks or 0
        self.kv_block_bytes = block_bytes(self.vllm_config)
        self.max_seqs = self.vllm_config.scheduler_config.max_num_seqs or 0
        self.kv_events = event_source(args)
        ktc = self.vllm_config.kv_transfer_config
        self._frees_held = ktc is not None and ktc.kv_connector == CPU_CONNECTOR
        # A utility call the engine core answers between steps (a flag it reads); its
        # processes are this worker's children.
        self._probe = EngineProbe(self.llm.is_paused, cpu=lambda: procfs.cpu_seconds(
            procfs.tree_of(procfs.children(os.getpid()))))

    def generate(self, request_id, prompt_token_ids, sampling_params):
        prompt = {"type": "token", "prompt_token_ids": prompt_token_ids}
        return self.llm.generate(prompt, sampling_params, request_id)

    async def abort(self, request_ids: list[str]) -> None:
        await self.llm.abort(request_ids)

    async def release(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        # vLLM's own path for "D rejected this request before admitting it": a pre-aborted
        # request whose connector hook tells the prefill engine to free the blocks.
        await self.llm.notify_kv_transfer_request_rejected(request_id, kv_transfer_params)

    async def release_held(self, request_ids: list[str]) -> None:
        # The same path into this engine's own connector (pdserve/kv/cpu_nixl.py), naming the
        # legs; after abort() on the same socket, so a prefill that was still running is gone.
        # vLLM's own NixlConnector (GPU hosts) has no such hook: there the lease frees them.
        if self._frees_held and request_ids:
            await self.llm.notify_kv_transfer_request_rejected(
                f"{request_ids[0]}-release", {protocol.RELEASE_HELD: list(request_ids)})

    def load(self) -> Load:
        return self._stats.load

    def unanswered(self) -> float:
        return self._probe.unanswered()

    async def check_health(self) -> None:
        await self.llm.check_health()

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        self.llm.shutdown()


class _LoadRecorder:
    """Keeps the latest scheduler figures vLLM reports, for the worker's heartbeats."""

    def __init__(self):
        self.load = Load()

    def factory(self, vllm_config, engine_index: int = 0):
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                       engine_idx: int = 0):
                if scheduler_stats is not None:
                    recorder.load = protocol.Load(
                        running=scheduler_stats.num_running_reqs,
                        waiting=scheduler_stats.num_waiting_reqs
                        + scheduler_stats.num_skipped_waiting_reqs,
                        kv_usage=float(scheduler_stats.kv_cache_usage),
                    )

            def log_engine_initialized(self):
                pass

        return _Logger(vllm_config, engine_index)
