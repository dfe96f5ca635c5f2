"""pdserve's engine configuration on a CPU host (issue 7), checked on the 1P1D `pd_server`, whose
launcher pins the prefill engine to core 0 and the decode engine to core 1. No timing bounds:
affinities, the connector in use, outputs, and how much CPU an idle engine burns.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import pytest
from procs import loopback_bytes, metric, ready_workers
from test_multihost import kv_bytes_per_token
from test_openai import complete, prompt_ids

from pdserve.worker.engine import parse_cores

CONNECTOR_LINE = "Creating v1 connector with name: PDCpuNixlConnector"
# How each engine's NIXL agent moves transfers: a prefill engine's progress thread, a decode
# engine's own thread.
PROGRESS_LINES = {"prefill": "progress thread polls every",
                  "decode": "reads moved by the engine's thread, no progress thread"}


@dataclass
class WorkerTree:
    """One `pdserve worker` process and its engine's processes."""

    pid: int
    role: str
    cores: str
    engine_cores: list[int] = field(default_factory=list)  # VLLM::EngineCore processes
    engine_workers: list[int] = field(default_factory=list)  # VLLM::Worker (model runners)

    @property
    def pids(self) -> list[int]:
        return [self.pid, *self.engine_cores, *self.engine_workers]

    @property
    def model_process(self) -> int:
        """The process that runs the model: a model runner if the engine has one, else its
        engine core."""
        return (self.engine_workers or self.engine_cores)[0]


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # fields from the 3rd (state) on


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                kids.setdefault(int(_stat(int(d))[1]), []).append(int(d))
            except OSError:
                pass  # exited meanwhile
    return kids


def _descendants(pid: int, kids: dict[int, list[int]]) -> list[int]:
    out, todo = [], list(kids.get(pid, ()))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def _comm(pid: int, tid: int | None = None) -> str:
    path = f"/proc/{pid}/task/{tid}/comm" if tid else f"/proc/{pid}/comm"
    with open(path) as f:
        return f.read().strip()


def _arg(cmd: list[str], name: str) -> str | None:
    """The last value of `--name V` or `--name=V` (argparse keeps the last)."""
    value = None
    for i, a in enumerate(cmd):
        if a == name and i + 1 < len(cmd):
            value = cmd[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def worker_trees(root_pid: int) -> dict[str, WorkerTree]:
    """The `pdserve worker` processes under `root_pid`, by role, with their engine processes."""
    kids = _children()
    trees: dict[str, WorkerTree] = {}
    for pid in _descendants(root_pid, kids):
        try:
            cmd = _cmdline(pid)
        except OSError:
            continue
        if "pdserve.cli" in cmd and "worker" in cmd and _arg(cmd, "--role"):
            t = WorkerTree(pid, _arg(cmd, "--role"), _arg(cmd, "--cores"))
            for p in _descendants(pid, kids):
                comm = _comm(p)
                if comm.startswith("VLLM::EngineCor"):
                    t.engine_cores.append(p)
                elif comm == "VLLM::Worker":
                    t.engine_workers.append(p)
            assert t.role not in trees, f"two {t.role} workers under {root_pid}"
            trees[t.role] = t
    return trees


def thread_affinities(pid: int) -> dict[int, tuple[str, set[int]]]:
    """Every thread of a process: tid -> (name, allowed cores)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                m = re.search(r"^Cpus_allowed_list:\s*(\S+)", f.read(), re.M)
            out[int(tid)] = (_comm(pid, int(tid)), parse_cores(m.group(1)))
        except OSError:
            pass  # a thread that ended meanwhile
    return out


def cpu_seconds(pid: int) -> float:
    f = _stat(pid)
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.fixture(scope="module")
def trees(pd_server) -> dict[str, WorkerTree]:
    t = worker_trees(pd_server.proc.pid)
    assert set(t) == {"prefill", "decode"}, t
    for tree in t.values():
        assert len(tree.engine_cores) == 1, tree
    return t


def test_each_engine_runs_its_model_in_its_engine_core(trees):
    """No model-runner process beside the engine core: on one core the two would busy-poll
    each other's queues (vLLM CPU's default executor)."""
    for role, t in trees.items():
        assert t.engine_workers == [], f"{role} engine has model runners: {t}"
        assert t.model_process == t.engine_cores[0]


def test_the_whole_worker_keeps_to_its_cores(trees):
    # The launcher gives each engine its own core: prefill 0, decode 1 (on this 2-core host).
    assert trees["prefill"].cores is not None and trees["decode"].cores is not None
    given = {role: parse_cores(t.cores) for role, t in trees.items()}
    assert given["prefill"].isdisjoint(given["decode"])
    if len(os.sched_getaffinity(0)) == 2:
        assert given == {"prefill": {0}, "decode": {1}}
    for role, t in trees.items():
        pid = t.model_process
        threads = thread_affinities(pid)
        # The model process's main thread (NIXL's base worker re-pins it to the last core: the
        # stolen core of issue 7) and its OpenMP compute threads, which carry its name.
        name = _comm(pid)
        compute = {tid: a for tid, a in threads.items() if tid == pid or a[0] == name}
        assert pid in compute and len(compute) >= 2, threads
        print(f"\n{role} engine ({name} {pid}): {len(compute)} compute threads on "
              f"{sorted(set().union(*(c for _, c in compute.values())))}; given {t.cores}")
        assert {tid: c for tid, (_, c) in compute.items() if c != given[role]} == {}, \
            f"{role} engine threads off their cores {given[role]}: {compute}"
        # The rest of the worker too: its own process, the engine's scheduler process and every
        # other thread (NIXL, UCX, ZMQ), so nothing of one engine runs on the other's core.
        for proc in t.pids:
            stray = {tid: a for tid, a in thread_affinities(proc).items()
                     if not a[1] <= given[role]}
            assert stray == {}, f"{role} process {proc}: threads off {given[role]}: {stray}"


def test_the_cpu_connector_is_in_use(pd_server, trees):
    log = pd_server.proc.log()
    for role, t in trees.items():
        mine = [ln for ln in log.splitlines() if f"pid={t.model_process})" in ln]
        assert any(CONNECTOR_LINE in ln for ln in mine), f"{role}: no {CONNECTOR_LINE!r}"
        assert any(PROGRESS_LINES[role] in ln for ln in mine), \
            f"{role}: no {PROGRESS_LINES[role]!r}"
        assert not any("with name: NixlConnector" in ln for ln in mine), role
    assert log.count(CONNECTOR_LINE) >= 2


def test_greedy_output_equals_a_single_engine(pd_client, ref_client, model_dir):
    prompt = prompt_ids(2 * 128 + 7, seed=7100)
    ours, _ = complete(pd_client, model_dir, prompt, max_tokens=24, temperature=0)
    ref, _ = complete(ref_client, model_dir, prompt, max_tokens=24, temperature=0)
    assert ours == ref


def test_engines_on_one_host_hand_the_kv_over_without_loopback_tcp(pd_server, pd_client,
                                                                    ref_client, model_dir):
    """The decode engine copies the prefill engine's blocks itself (UCX's cma, pdserve's default
    on a CPU host): the KV does not cross loopback TCP, which carries the rest of the request
    (the client's HTTP, the control plane's legs; counted machine-wide)."""
    prompt = prompt_ids(2000, seed=27182)  # no other test's seed: never seen by either engine
    block = ready_workers(pd_server.base, "decode")[0]["block_size"]
    kv = len(prompt) // block * block * kv_bytes_per_token(model_dir)  # ~2 MB, tiny model
    read_before = metric(pd_server.base, "pdserve_kv_read_tokens_total")
    lo_before = loopback_bytes()
    ours, _ = complete(pd_client, model_dir, prompt, max_tokens=4, temperature=0)
    crossed = loopback_bytes() - lo_before
    read = metric(pd_server.base, "pdserve_kv_read_tokens_total") - read_before
    ref, _ = complete(ref_client, model_dir, prompt, max_tokens=4, temperature=0)
    assert ours == ref
    assert read >= len(prompt) // block * block, read  # the decode engine read the KV
    assert crossed < kv // 4, f"{crossed} bytes over loopback for {kv} bytes of KV"


def test_idle_engines_do_not_spin(pd_server, trees, pool):
    """A figure, not a timing bound: stock NIXL's progress thread keeps a whole core busy
    (~100%); pdserve's sleeps between polls. Anything near a busy core fails."""
    # Idle: nothing running or in flight on either worker.
    deadline = time.monotonic() + 60
    while any(w["running"] or w["waiting"] or w["inflight"] for w in pool()):
        assert time.monotonic() < deadline, pool()
        time.sleep(0.5)
    time.sleep(2)
    pids = {role: t.pids for role, t in trees.items()}
    before = {p: cpu_seconds(p) for ps in pids.values() for p in ps}
    t0 = time.monotonic()
    time.sleep(5)
    elapsed = time.monotonic() - t0
    busy = any(w["running"] or w["waiting"] or w["inflight"] for w in pool())
    share = {role: sum(cpu_seconds(p) - before[p] for p in ps) / elapsed
             for role, ps in pids.items()}
    print("\nidle CPU over 5 s (worker + engine processes): " +
          ", ".join(f"{role} {100 * s:.1f}% of a core" for role, s in share.items()))
    assert not busy, "a request arrived during the idle measurement"
    for role, s in share.items():
        assert s < 0.5, f"idle {role} worker used {100 * s:.0f}% of a core"
