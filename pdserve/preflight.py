"""What `pdserve serve` checks before it starts anything: a machine that cannot run it fails in a
second with one sentence saying what to change, not minutes later inside an engine's log."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from pdserve.net import bind_error

GIB = 1 << 30
# Memory (PSS) beside the KV cache and the weights, measured on the tiny model on CPU while it
# served: a worker's two processes (pdserve's 0.43 GiB, vLLM's engine core running the model
# 0.47 GiB), the controller ~0.45 GiB. (vLLM's multiprocess executor, if a worker is told to use
# it, adds a model-runner process of ~0.5 GiB.)
WORKER_GIB = 1.0
CONTROLLER_GIB = 0.5


def port_problem(host: str, port: int, flag: str) -> str | None:
    """Why a server of ours could not listen on host:port (`flag` chooses another), or None."""
    err = bind_error(host, port)
    if err is None:
        return None
    if err.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is in use by another program (another pdserve?): stop "
                f"it, or choose a free port with {flag}")
    return f"cannot listen on {host}:{port} ({err.strerror or err}): check --host and {flag}"


def memory_problem(workers: int, kv_gib: float, weights_gib: float,
                   available_gib: float | None, controllers: int = 1) -> str | None:
    """Why `workers` CPU workers (and `controllers` API servers) would not fit in memory, or
    None."""
    each = WORKER_GIB + kv_gib + weights_gib
    need = controllers * CONTROLLER_GIB + workers * each
    if available_gib is None or need <= available_gib:
        return None
    return (f"not enough memory: {workers} worker(s) need about {need:.1f} GiB ({each:.1f} GiB "
            f"each, {kv_gib:g} GiB of it KV cache) and {available_gib:.1f} GiB is available: free "
            "some memory, or start fewer workers (--prefill, --decode)")


def available_gib(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """The kernel's estimate of memory available without swapping (None where unknown)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_cache_gib(worker_args: list[str], env: Mapping[str, str] = os.environ) -> float:
    """Each CPU worker's KV cache: VLLM_CPU_KVCACHE_SPACE wins (worker/engine.py), then the
    workers' --kv-cache-gib, else its default of 1."""
    if env.get("VLLM_CPU_KVCACHE_SPACE"):
        return float(env["VLLM_CPU_KVCACHE_SPACE"])
    value = "1"
    for i, arg in enumerate(worker_args):
        if arg == "--kv-cache-gib" and i + 1 < len(worker_args):
            value = worker_args[i + 1]
        elif arg.startswith("--kv-cache-gib="):
            value = arg.split("=", 1)[1]
    try:
        return float(value)
    except ValueError:
        return 1.0  # the worker itself will say what is wrong with it


def weights_gib(model_dir: str | None) -> float:
    """Size of the model's weight files (0 for a folder that does not exist yet)."""
    if not model_dir or not os.path.isdir(model_dir):
        return 0.0
    files = [p for p in Path(model_dir).iterdir() if p.suffix in (".safetensors", ".bin", ".pt")]
    return sum(p.stat().st_size for p in files) / GIB


def cpu_build() -> bool:
    """Whether vLLM is its CPU build, whose KV cache and weights live in this host's memory."""
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True
