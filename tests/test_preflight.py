"""What `pdserve serve` checks before it starts anything (pdserve/preflight.py)."""

from __future__ import annotations

import socket

from pdserve import preflight
from pdserve.net import bind_error, free_port


def test_a_taken_port_and_a_free_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        problem = preflight.port_problem("127.0.0.1", port, "--worker-port")
        assert problem is not None and f"port {port} on 127.0.0.1 is in use" in problem
        assert problem.endswith("choose a free port with --worker-port")
    assert preflight.port_problem("127.0.0.1", free_port(), "--port") is None


def test_an_address_that_is_not_this_hosts() -> None:
    problem = preflight.port_problem("192.0.2.1", free_port(), "--port")  # TEST-NET-1
    assert problem is not None and problem.startswith("cannot listen on 192.0.2.1:")
    assert bind_error("no-such-host.invalid", 80) is not None


def test_memory_enough_and_too_little() -> None:
    each = preflight.WORKER_GIB + 1 + 0.5
    enough = preflight.CONTROLLER_GIB + 2 * each
    assert preflight.memory_problem(2, kv_gib=1, weights_gib=0.5, available_gib=enough) is None
    assert preflight.memory_problem(2, 1, 0.5, available_gib=None) is None  # unknown: no check
    problem = preflight.memory_problem(2, 1, 0.5, available_gib=enough - 0.1)
    assert problem == (f"not enough memory: 2 worker(s) need about {enough:.1f} GiB ({each:.1f} "
                       f"GiB each, 1 GiB of it KV cache) and {enough - 0.1:.1f} GiB is available: "
                       "free some memory, or start fewer workers (--prefill, --decode)")


def test_the_kv_cache_size_as_the_workers_will_take_it() -> None:
    assert preflight.kv_cache_gib([], env={}) == 1
    assert preflight.kv_cache_gib(["--kv-cache-gib", "4"], env={}) == 4
    assert preflight.kv_cache_gib(["--max-model-len=99", "--kv-cache-gib=3"], env={}) == 3
    assert preflight.kv_cache_gib(["--kv-cache-gib=3"], env={"VLLM_CPU_KVCACHE_SPACE": "2"}) == 2
    assert preflight.kv_cache_gib(["--kv-cache-gib=lots"], env={}) == 1


def test_available_memory_and_weights(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    2097152 kB\n")
    assert preflight.available_gib(meminfo) == 2.0
    assert preflight.available_gib(tmp_path / "none") is None
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1024)
    (tmp_path / "config.json").write_bytes(b"{}" * 4096)
    assert preflight.weights_gib(str(tmp_path)) == 1024 / preflight.GIB
    assert preflight.weights_gib(str(tmp_path / "not-built-yet")) == 0.0
    assert preflight.weights_gib(None) == 0.0


def test_memory_counts_each_api_server() -> None:
    each = preflight.WORKER_GIB + 1 + 0.5
    one = preflight.CONTROLLER_GIB + 2 * each
    assert preflight.memory_problem(2, 1, 0.5, available_gib=one) is None
    assert preflight.memory_problem(2, 1, 0.5, available_gib=one, controllers=3) is not None
    assert preflight.memory_problem(2, 1, 0.5, available_gib=one + 2 * preflight.CONTROLLER_GIB,
                                    controllers=3) is None
