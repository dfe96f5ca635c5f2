"""NixlConnector for CPU hosts: same transfers, no spinning thread, no stolen core.

vLLM 0.32's NIXL worker does two things that hurt a CPU-only host (measured in issue 7):
1. it builds the NIXL agent with the default config, whose UCX progress thread polls with
   zero delay and keeps a whole core busy even when nothing moves;
2. it pins the engine's main thread to the last core of each NUMA node "to reserve cores for
   KV loads", so every engine on a one-node machine computes on the same core, whatever
   VLLM_CPU_OMP_THREADS_BIND said.

This subclass is loaded through vLLM's out-of-tree hook (``kv_connector_module_path``). On the
CPU platform it builds the agent without the progress thread (vLLM polls the connector every
engine step while a transfer is pending, which is what makes progress) and puts the thread
affinity back to what the engine had. On any other platform it is NixlConnector unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.logger import init_logger
from vllm.platforms import current_platform

logger = init_logger(__name__)

CONNECTOR_NAME = "PDCpuNixlConnector"


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """Make the NIXL worker module build its agent without a progress thread."""
    original = base_worker.nixl_agent_config
    if original is None:  # NIXL not installed: let the parent raise its own error
        yield
        return
    base_worker.nixl_agent_config = functools.partial(original, enable_prog_thread=False)
    try:
        yield
    finally:
        base_worker.nixl_agent_config = original


class PDCpuNixlConnector(NixlPullConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        if role != KVConnectorRole.WORKER or not current_platform.is_cpu():
            super().__init__(vllm_config, role, kv_cache_config)
            return
        affinity = os.sched_getaffinity(0)
        with _quiet_agent():
            super().__init__(vllm_config, role, kv_cache_config)
        if os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        logger.info(
            "pdserve CPU NIXL connector: progress thread off, affinity kept at %s",
            sorted(affinity),
        )
