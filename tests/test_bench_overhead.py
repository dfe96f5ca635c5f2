"""`pdserve bench overhead`'s baseline server (vLLM's over an in-process fake engine) and its
report."""

from __future__ import annotations

import asyncio
import os

import pytest
from procs import thread_cpus
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from pdserve import fake
from pdserve.bench import inproc, overhead

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def client():
    from vllm.engine.arg_utils import AsyncEngineArgs

    from pdserve.models import ensure_model

    config = AsyncEngineArgs(model=str(ensure_model("tiny")), dtype="float32",
                             enforce_eager=True).create_engine_config()
    return inproc.InprocClient(config, fake.FakeEngine())


def _run(client, kind: RequestOutputKind, n: int = 6) -> list:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=kind)

    async def go():
        return [o async for o in client.generate({"prompt_token_ids": [3, 4, 5]}, params,
                                                 f"r-{kind.name}")]

    return asyncio.run(go())


def test_inproc_client_streams_the_fake_engines_tokens(client):
    want = fake.reference([3, 4, 5], SamplingParams(max_tokens=6, temperature=0.0,
                                                    ignore_eos=True))
    outs = _run(client, RequestOutputKind.DELTA)
    assert [t for o in outs for t in o.outputs[0].token_ids] == want.token_ids
    assert "".join(o.outputs[0].text for o in outs) == want.text
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    final = _run(client, RequestOutputKind.FINAL_ONLY)
    assert len(final) == 1 and list(final[0].outputs[0].token_ids) == want.token_ids


def test_engine_cost_is_positive():
    assert inproc.engine_cost(4, 8, 8, 16, 0.0) > 0


def test_part_c_table():
    row = {"server": "vllm", "concurrency": 32, "round": 0, "tokens": 100, "failed": 0,
           "output_tok_s": 2900.0, "server_core_pct": 20.0, "server_us_per_token": 70.0,
           "tokens_per_chunk": 1.0, "workers_core_pct": 0.0, "client_core_pct": 60.0,
           "others_core_pct": 1.0, "itl_p50_ms": 10.8, "itl_p99_ms": 13.0, "x_vllm": 1.0}
    md = overhead.markdown({"command": "c", "model": "m",
                            "c": {"workload": "w", "rows": [row],
                                  "engine_us_per_token": {32: 25.0}}})
    assert "## (c)" in md and "| vllm | 32 | 0 | 2,900 | 20 | 70 | 1.00 | 1.00 |" in md
    assert "25 us of CPU per token" in md


def test_part_c_gives_each_servers_median_ratio_over_its_rounds():
    rows = [{"server": s, "concurrency": 32, "round": i, "x_vllm": x}
            for i, (s, x) in enumerate([("vllm", 1.0), ("pdserve 1P1D", 1.3), ("vllm", 1.0),
                                        ("pdserve 1P1D", 1.1), ("pdserve 1P1D", 1.5)])]
    assert overhead.ratios_by_server(rows) == [("pdserve 1P1D", 32, [1.3, 1.1, 1.5])]
    md = overhead.markdown({"command": "c", "model": "m", "c": {"workload": "w", "rows": []}})
    assert "median" not in md  # no rounds, no median


def test_vllms_own_server_runs_its_model_as_a_worker_engine_does(tmp_path, monkeypatch):
    """The baseline that a worker's engine is measured against gets the same executor on a CPU
    host (one process), unless the bench is told otherwise; elsewhere vLLM chooses."""
    from pdserve.bench import cluster
    from pdserve.worker.engine import IN_ENGINE_CORE_EXECUTOR

    def executor_args(cpu: bool, extra: list[str] | None = None) -> list[str]:
        monkeypatch.setattr(cluster, "is_cpu_host", lambda: cpu)
        cmd = cluster.VllmDeployment("m", tmp_path, extra=extra).command(8000)
        return [a for i, a in enumerate(cmd) if "executor" in a or (i and "executor" in cmd[i - 1])]

    assert executor_args(True) == ["--distributed-executor-backend", IN_ENGINE_CORE_EXECUTOR]
    assert executor_args(True, ["--distributed-executor-backend=mp"]) == [
        "--distributed-executor-backend=mp"]
    assert executor_args(False) == []


def test_the_benchs_controller_keeps_to_the_prefill_workers_cores(tmp_path):
    """As `pdserve serve` starts it; the report's core column names them (`PdDeployment.cores`)."""
    from pdserve.bench import cluster
    from pdserve.models import ensure_model

    core = min(os.sched_getaffinity(0))
    model = str(ensure_model("tiny"))
    with cluster.PdDeployment(cluster.Config("1P1D", prefill=1, decode=1), model, tmp_path,
                              keys=False, cores=[core, core],
                              worker_cmd=overhead.fake_worker_cmd(model)) as dep:
        dep.start(300)
        kept = thread_cpus(dep.groups()["controller"])
    assert dep.cores["controller"] == str(core)
    assert kept == {frozenset({core})}
