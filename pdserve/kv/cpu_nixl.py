"""NixlConnector for CPU hosts: same transfers, no spinning thread, no stolen core.

vLLM 0.32's NIXL worker does two things that hurt a CPU-only host (measured in issue 7):
1. it builds the NIXL agent with the default config, whose UCX progress thread polls with
   zero delay and keeps a whole core busy even when nothing moves;
2. it pins the engine's main thread to the last core of each NUMA node "to reserve cores for
   KV loads", so every engine on a one-node machine computes on the same core, whatever
   VLLM_CPU_OMP_THREADS_BIND said.

This subclass is loaded through vLLM's out-of-tree hook (``kv_connector_module_path``). On the
CPU platform it builds the agent with a progress thread that sleeps between polls, and puts the
thread affinity back to what the engine had. On every platform it fails the engine's start when
its side-channel port is taken (vLLM would wait for it for good), caps a decode read at what the
prefill computed and reports what each read moved.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.logger import init_logger
from vllm.platforms import current_platform

from pdserve.net import bind_error
from pdserve.protocol import KV_READ_STATS

# Under vLLM's logger: this runs in the engine's processes, where only vLLM's handler exists
# (a "pdserve.*" logger there has none, and its INFO lines were lost).
logger = init_logger(f"vllm.{__name__}")

CONNECTOR_NAME = "PDCpuNixlConnector"


# How long NIXL's UCX progress thread sleeps between polls, in microseconds. NIXL's Python
# wrapper hard-codes 0 (poll without pause: a whole core). The thread must exist: without it a
# prefill engine that is idle while holding blocks never answers a new decode peer's UCX
# wire-up, and that peer's read waits until the blocks' lease expires.
PROGRESS_DELAY_US = int(os.environ.get("PDSERVE_NIXL_PROGRESS_DELAY_US", "2000"))


@contextlib.contextmanager
def _sleepy_progress_thread() -> Iterator[None]:
    """Make the NIXL agent built inside this block poll with PROGRESS_DELAY_US between rounds."""
    wrapper = base_worker.NixlWrapper
    api = sys.modules.get(getattr(wrapper, "__module__", ""), None)
    bind = getattr(api, "nixlBind", None)
    if bind is None:  # NIXL missing or laid out differently: let the parent do its own thing
        yield
        return
    original = bind.nixlAgent

    def make_agent(name, config):
        config.pthrDelay = PROGRESS_DELAY_US
        return original(name, config)

    bind.nixlAgent = make_agent
    try:
        yield
    finally:
        bind.nixlAgent = original


# How long an engine step that ran no model may wait for the KV reads in flight before it
# reports what is done. vLLM's engine notices a finished read only at the end of a step and
# sleeps 1 ms after every step that ran no model, so a read that lands just after the check
# costs that sleep and another step; most land within a millisecond of being posted.
READ_WAIT_S = int(os.environ.get("PDSERVE_NIXL_READ_WAIT_US", "1000")) / 1e6
_POLL_S = 50e-6


class SideChannelTaken(RuntimeError):
    """The KV side-channel port is taken: the engine cannot start."""


class PDCpuNixlConnector(NixlPullConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        # Decode side (scheduler): request id -> [tokens its prefix cache had, tokens to read,
        # when the read was asked for, when it was done] (protocol.KV_READ_STATS).
        self._reads: dict[str, list[float]] = {}
        self._wait_for_reads = False  # worker side: this step ran no model, so it may wait
        self._may_wait = current_platform.is_cpu() and READ_WAIT_S > 0
        if role != KVConnectorRole.WORKER or not current_platform.is_cpu():
            super().__init__(vllm_config, role, kv_cache_config)
            return
        affinity = os.sched_getaffinity(0)
        with _sleepy_progress_thread():
            super().__init__(vllm_config, role, kv_cache_config)
        if os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        logger.info(
            "pdserve CPU NIXL connector: progress thread polls every %d us, affinity kept at %s",
            PROGRESS_DELAY_US, sorted(affinity),
        )

    # ---- the side channel (scheduler side) -------------------------------------------------

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        # vLLM's listener thread binds the side-channel port, and the engine's start waits for it
        # without a timeout: a port another process took since the worker chose it would hang
        # the start for good. Fail it with the reason instead (the worker exits, and `pdserve
        # serve` restarts it with another port).
        sched = self.connector_scheduler
        if sched is not None and getattr(sched, "_nixl_handshake_listener_t", None) is None:
            host, port = sched.side_channel_host, sched.side_channel_port
            if (err := bind_error(host, port)) is not None:
                raise SideChannelTaken(
                    f"the KV side channel cannot listen on {host}:{port} ({err}): another "
                    "process holds the port; start the worker again (without --kv-port it "
                    "picks another free one) or give it a free --kv-port")
        super().set_xfer_handshake_metadata_pp_aware(metadata)

    # ---- a read that lands within the step is reported by it (worker side, CPU) ------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # vLLM runs a step without a model (no attention metadata) only to move KV.
        self._wait_for_reads = (self._may_wait
                                and getattr(forward_context, "attn_metadata", None) is None)
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        if self._wait_for_reads:
            self._until_reads_land(time.monotonic() + READ_WAIT_S)
        return super().get_transfer_results(finished_req_ids)

    def _until_reads_land(self, deadline: float) -> None:
        """Poll the reads in flight until none is in progress, or the deadline."""
        worker = self.connector_worker
        transfers = getattr(worker, "_recving_transfers", None)
        while transfers and time.monotonic() < deadline:
            try:
                busy = any(worker.nixl_wrapper.check_xfer_state(h) == "PROC"
                           for handles in transfers.values() for h in handles)
            except Exception:  # a failed transfer: vLLM's own check reports it
                return
            if not busy:
                return
            time.sleep(_POLL_S)

    # ---- what a decode read moved (scheduler side), reported with the request's end --------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        count, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            # Read no further than the prefill computed. vLLM's reader asks for the whole
            # prompt, but a decode leg whose context is the prompt plus the prefill's sampled
            # token (controller/sequence.py) has one position more: its KV is computed here,
            # where that token is sampled from, so the next token comes a step sooner.
            held = params.get("remote_num_tokens")
            if count and held:
                count = max(0, min(count, held - num_computed_tokens))
                is_async = is_async and count > 0
            # vLLM's reader pulls only the blocks past the engine's own prefix-cache hit.
            self._reads[request.request_id] = [num_computed_tokens, count or 0, 0.0, 0.0]
        return count, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        read = self._reads.get(request.request_id)
        if read is not None and num_external_tokens:
            read[2] = time.monotonic()  # the read goes out with this step's metadata
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        now = time.monotonic()
        for req_id in connector_output.finished_recving or ():
            if (read := self._reads.get(req_id)) is not None:
                read[3] = now

    def request_finished(self, request: Any, block_ids: Any):
        delay, params = super().request_finished(request, block_ids)
        return delay, self._with_read(request, params)

    def request_finished_all_groups(self, request: Any, block_ids: Any):
        delay, params = super().request_finished_all_groups(request, block_ids)
        return delay, self._with_read(request, params)

    def _with_read(self, request: Any, params: dict[str, Any] | None) -> dict[str, Any] | None:
        read = self._reads.pop(request.request_id, None)
        if read is None:
            return params
        return {**(params or {}), KV_READ_STATS: read}
