"""The serving configurations the benchmark starts, one at a time, on this machine's cores.

- XpYd: `pdserve serve --prefill X --decode Y` as the launcher runs it (a controller, then X
  prefill and Y decode workers, the cores split evenly between them while there are enough).
- colocated (N engines): the same controller with N workers of role `both` and a local-prefill
  threshold above any prompt, so each request runs whole on one engine with vLLM's chunked
  prefill, behind the same HTTP front end as P/D.
- Nauto: N workers of role `auto`, each given a duty (prefill, decode or both) by the
  controller's planner, which aims at the bench's SLO (planner_args).
- vLLM's plain OpenAI server on one core (the controller-overhead baseline).
- P then D through vllm-router: two vLLM servers with pdserve's CPU connector behind vLLM's
  router (the peer path `bench handoff --router` sets pdserve's handoff beside).
Every child runs in its own process group and is stopped as a group (a worker's engine core,
in a group of its own, stops with its worker: pdserve/worker/engine_proc.py).
"""

from __future__ import annotations

import abc
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from pdserve import launcher
from pdserve.bench.metrics import Slo
from pdserve.leftovers import temp_env
from pdserve.net import free_port, keep_idle_connections
from pdserve.protocol import Role
from pdserve.supervisor import Child, stop_children
from pdserve.worker.engine import (IN_ENGINE_CORE_EXECUTOR, EngineSettings, engine_env,
                                   is_cpu_host, kv_transfer_config, parse_cores)
from pdserve.worker.stop_signals import ENGINE_OWN_GROUP_ENV

ALL_LOCAL = 10**9  # a local-prefill threshold no prompt reaches
WorkerCmd = Callable[[str, str, "str | None", "str | None"], list[str]]


@dataclass(frozen=True)
class Config:
    name: str
    prefill: int = 0
    decode: int = 0
    both: int = 0
    # Controller's --local-prefill-threshold for XpYd; None keeps the controller's default.
    local_threshold: int | None = None
    decode_first: bool = False  # controller's --first-token decode
    routing: str = ""  # a ROUTING key: "" keeps the controller's defaults
    auto: int = 0  # workers of role auto: the controller's planner gives each its duty
    slo_placement: bool = False  # controller's --placement slo (with the planner's arguments)

    @property
    def engines(self) -> int:
        return self.prefill + self.decode + self.both + self.auto

    @property
    def colocated(self) -> bool:
        return self.both > 0

    def roles(self) -> list[str]:
        return (["prefill"] * self.prefill + ["decode"] * self.decode + ["both"] * self.both
                + ["auto"] * self.auto)


# How a configuration routes (issue 12's comparison): blind to the engines' caches, today's
# estimate of what this controller sent where, or the engines' own KV events.
ROUTING = {
    "blind": ["--prefill-policy", "least_loaded", "--decode-policy", "least_loaded",
              "--no-kv-index"],
    "prefix": ["--prefill-policy", "prefix_aware", "--decode-policy", "kv_aware",
               "--no-kv-index"],
    "kv": ["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware"],
}


def parse_configs(spec: str) -> list[Config]:
    """`1P1D,2P1D@0,1P1D@0:decode-first,colocated,2auto`: `@T` sets the controller's
    local-prefill threshold (`@0`: every prompt goes through the KV handoff), `:decode-first` its
    `--first-token decode`, `:blind`, `:prefix` or `:kv` its routing (ROUTING), `:slo` its
    `--placement slo`; `Nauto` is N workers of role auto; `colocated` has as many engines as the
    largest XpYd or Nauto listed (2 if none); `colocatedN` sets N."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    out: list[Config | str] = []
    for name in names:
        if m := re.fullmatch(r"(\d+)P(\d+)D(?:@(\d+))?(:decode-first)?(?::(blind|prefix|kv))?"
                             r"(:slo)?", name, re.IGNORECASE):
            x, y = int(m[1]), int(m[2])
            if x < 1 or y < 1:
                raise ValueError(f"{name}: need at least one prefill and one decode worker")
            t = None if m[3] is None else int(m[3])
            routing = (m[5] or "").lower()
            label = (f"{x}P{y}D" + ("" if t is None else f"@{t}")
                     + (":decode-first" if m[4] else "") + (f":{routing}" if routing else "")
                     + (":slo" if m[6] else ""))
            out.append(Config(label, prefill=x, decode=y, local_threshold=t,
                              decode_first=bool(m[4]), routing=routing,
                              slo_placement=bool(m[6])))
        elif m := re.fullmatch(r"(\d+)auto(:slo)?", name, re.IGNORECASE):
            if int(m[1]) < 1:
                raise ValueError(f"{name}: need at least one auto worker")
            out.append(Config(f"{int(m[1])}auto" + (":slo" if m[2] else ""), auto=int(m[1]),
                              slo_placement=bool(m[2])))
        elif m := re.fullmatch(r"colocated(\d*)", name, re.IGNORECASE):
            out.append(m[1] or "colocated")
        else:
            raise ValueError(f"unknown configuration {name!r}: want "
                             "XpYd[@T][:decode-first][:blind|:prefix|:kv][:slo] (e.g. 1P1D, "
                             "1P1D@0, 1P2D@256:kv, 1P1D:slo), Nauto[:slo] (e.g. 2auto) or "
                             "colocated[N]")
    n = max((c.engines for c in out if isinstance(c, Config)), default=2)
    return [c if isinstance(c, Config) else Config("colocated", both=int(c) if c != "colocated"
                                                   else n) for c in out]


def planner_args(slo: Slo, profile: str | None = None, extra: str = "") -> list[str]:
    """Controller arguments of an auto configuration: the bench's SLO as the planner's target
    (so it aims at what the bench scores), the cost profile if one is given, then `extra`
    (shell words, e.g. "--plan-interval 2")."""
    targets = [f"{k}:{v:g}" for k, v in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms))
               if v is not None]
    out = ["--slo", *targets] if targets else []
    if profile:
        out += ["--profile", profile]
    return out + shlex.split(extra)


def bench_env(tmp: Path) -> dict[str, str]:
    """The environment of a bench's children: their temporary files in the run's own folder
    (vLLM's server left a `vllm_dist_*` file in the system's at every start)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **temp_env(tmp))
    keep_idle_connections(env)  # vLLM's own servers too: the client keeps idle ones 60 s
    return env


def _get(url: str, timeout: float = 2.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return int(r.status)


class Deployment(abc.ABC):
    """Children started in their own process groups, logs in `logdir`."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.children: list[Child] = []
        self.base_url = ""
        logdir.mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, cmd: list[str], env: dict[str, str],
              cpus: set[int] | None = None, worker: bool = True) -> Child:
        """Start a child in its own process group; `cpus`: keep it and its children there."""
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        with open(self.logdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=pin)
        child = Child(name, proc, worker=worker)
        self.children.append(child)
        return child

    @abc.abstractmethod
    def start(self, timeout: float = 600.0) -> str:
        """Start the children, wait until they serve; return the HTTP base URL."""

    def wait_healthy(self, child: Child, what: str, timeout: float) -> None:
        """Until `child` answers /health at base_url; stops everything if it exits or never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{what} exited with {child.proc.returncode}; "
                                   f"see {self.logdir}/{child.name}.log")
            try:
                if _get(self.base_url + "/health") == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{what} not ready after {timeout:.0f} s")

    def groups(self) -> dict[str, int]:
        """Process-group id of each child, by name (a child leads its own group)."""
        return {c.name: c.proc.pid for c in self.children}

    def stop(self) -> None:
        stop_children(self.children, drain_timeout=20)
        self.children.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def real_worker(role: str, controller: str, core: str | None, keys: str | None,
                model: str, extra: list[str]) -> list[str]:
    return launcher.worker_command(role, controller, model, core, keys, extra)


class PdDeployment(Deployment):
    """A pdserve controller and workers for `cfg`, as `pdserve serve` starts them."""

    def __init__(self, cfg: Config, model: str, workdir: Path, *, keys: bool = True,
                 controller_args: list[str] | None = None, worker_args: list[str] | None = None,
                 worker_cmd: WorkerCmd | None = None, cores: list[int] | None = None,
                 auto_args: list[str] | None = None):
        super().__init__(workdir / "logs" / cfg.name)
        self.all_cores = cores  # split between the workers (default: all of this process's)
        self.cfg, self.model, self.workdir = cfg, model, workdir
        self.keys = keys
        self.controller_args = list(controller_args or [])
        self.worker_args = list(worker_args or [])
        # planner_args(), for auto and :slo configurations only
        self.auto_args = list(auto_args or [])
        self.worker_cmd = worker_cmd
        self.cores: dict[str, str | None] = {}  # by process group: each worker, the controller

    def controller_command(self, port: int, wport: int, keydir: str | None,
                           cores: str | None = None) -> list[str]:
        ctl = [sys.executable, "-m", "pdserve.cli", "controller", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(port), "--worker-host", "127.0.0.1",
               "--worker-port", str(wport), "--disable-uvicorn-access-log"]
        if self.cfg.colocated:
            ctl += ["--local-prefill-threshold", str(ALL_LOCAL)]
        elif self.cfg.local_threshold is not None:
            ctl += ["--local-prefill-threshold", str(self.cfg.local_threshold)]
        if self.cfg.decode_first:
            ctl += ["--first-token", "decode"]
        ctl += ROUTING.get(self.cfg.routing, [])
        if self.cfg.slo_placement:
            ctl += ["--placement", "slo"]
        if self.cfg.auto or self.cfg.slo_placement:
            ctl += self.auto_args
        if keydir:
            ctl += ["--keys", keydir]
        if cores:
            ctl += ["--cores", cores]
        return ctl + self.controller_args

    def start(self, timeout: float = 600.0) -> str:
        from pdserve.transport import keygen

        tmp = self.workdir / "run"
        tmp.mkdir(parents=True, exist_ok=True)
        env = bench_env(tmp)
        keydir = None
        if self.keys:
            keydir = str(tmp / f"keys-{self.cfg.name}")
            if not os.path.isdir(keydir):
                keygen(keydir)
        port, wport = free_port(), free_port()
        roles = self.cfg.roles()
        available = self.all_cores or sorted(os.sched_getaffinity(0))
        cores = launcher.assign_cores(len(roles), available)
        self.cores["controller"] = launcher.controller_cores(roles, cores, self.controller_args)
        self.spawn("controller", self.controller_command(port, wport, keydir,
                                                         self.cores["controller"]), env,
                   worker=False)
        controller = f"tcp://127.0.0.1:{wport}"
        for i, (role, core) in enumerate(zip(roles, cores)):
            name = f"{role}-{i}"
            self.cores[name] = core
            if self.worker_cmd is not None:
                cmd = self.worker_cmd(role, controller, core, keydir)
            else:
                cmd = real_worker(role, controller, core, keydir, self.model, self.worker_args)
            self.spawn(name, cmd, env)
        self.base_url = f"http://127.0.0.1:{port}"
        try:
            launcher.wait_ready(self.base_url, len(roles), self.children, timeout)
        except BaseException:
            self.stop()
            raise
        return self.base_url


def engine_mode(worker_args: list[str]) -> list[str]:
    """The workers' flags that vLLM's server in a comparison must be given too: its engine then
    runs as theirs (compiled by default in both)."""
    return [a for a in worker_args if a in ("--enforce-eager", "--no-enforce-eager")]


class VllmDeployment(Deployment):
    """vLLM's own OpenAI server, one engine, the whole server kept to `core` as a pdserve worker
    keeps itself, and on CPU with the executor a worker's engine gets (the overhead baseline).
    With `role`, one of a P/D pair: pdserve's KV connector in that role, and the environment a
    worker gives its engine (the KV transports, the side channel's port)."""

    def __init__(self, model: str, workdir: Path, core: str | None = "0",
                 extra: list[str] | None = None, role: Role | None = None,
                 name: str = "vllm"):
        super().__init__(workdir / "logs" / name)
        self.model, self.workdir, self.core, self.role = model, workdir, core, role
        self.extra = list(extra or [])

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--dtype", "float32", "--host", "127.0.0.1", "--port",
                str(port), "--disable-uvicorn-access-log", *self.executor(), *self.connector(),
                *self.extra]

    def executor(self) -> list[str]:
        if "--distributed-executor-backend" in " ".join(self.extra) or not is_cpu_host():
            return []
        return ["--distributed-executor-backend", IN_ENGINE_CORE_EXECUTOR]

    def connector(self) -> list[str]:
        if self.role is None:
            return []
        return ["--kv-transfer-config", json.dumps(kv_transfer_config(self.role, is_cpu_host()))]

    def environment(self, tmp: Path) -> dict[str, str]:
        env = bench_env(tmp)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if self.core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.core
        if self.role is not None:
            settings = EngineSettings(self.role, kv_port=free_port(), cores=self.core)
            env.update(engine_env(settings, is_cpu_host()))
            del env[ENGINE_OWN_GROUP_ENV]  # names a pdserve worker; this server is none
        return env

    def start(self, timeout: float = 600.0) -> str:
        tmp = self.workdir / "run"
        tmp.mkdir(parents=True, exist_ok=True)
        port = free_port()
        cpus = None if self.core is None else parse_cores(self.core)
        child = self.spawn("vllm-server", self.command(port), self.environment(tmp), cpus,
                           worker=False)
        self.base_url = f"http://127.0.0.1:{port}"
        self.wait_healthy(child, "vLLM server", timeout)
        return self.base_url


# vllm-router, vLLM's router with P/D over NIXL: pdserve's bench extra (pyproject.toml).
ROUTER_PACKAGE = "vllm-router==0.1.17"


class RouterDeployment(Deployment):
    """P then D through vllm-router, the peer path pdserve's handoff is measured against: two
    vLLM servers with pdserve's CPU connector, the prefill one on `cores[0]` and the decode one
    on `cores[1]`, and the router where pdserve's controller runs (the prefill core). The router
    asks the prefill server for one token, then streams the decode server's answer, which reads
    the prompt's KV from the prefill engine."""

    def __init__(self, model: str, workdir: Path, cores: list[int],
                 extra: list[str] | None = None):
        super().__init__(workdir / "logs" / "router")
        self.workdir, self.core = workdir, cores[0]
        self.servers = [VllmDeployment(model, workdir, str(core), extra, role, f"router-{name}")
                        for role, name, core in ((Role.PREFILL, "prefill", cores[0]),
                                                 (Role.DECODE, "decode", cores[1]))]

    def start(self, timeout: float = 600.0) -> str:
        prefill, decode = [s.start(timeout) for s in self.servers]  # one at a time
        tmp = self.workdir / "run"
        port = free_port()
        cmd = [router_program(), "--vllm-pd-disaggregation", "--prefill", prefill, "--decode",
               decode, "--host", "127.0.0.1", "--port", str(port),
               # its metrics on a port of their own (29000 by default: a second router fails)
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        child = self.spawn("vllm-router", cmd, bench_env(tmp), {self.core}, worker=False)
        self.base_url = f"http://127.0.0.1:{port}"
        self.wait_healthy(child, "vllm-router", timeout)
        return self.base_url

    @property
    def decode_url(self) -> str:
        return self.servers[1].base_url

    def groups(self) -> dict[str, int]:
        out = super().groups()
        for s in self.servers:
            out |= {s.logdir.name: pid for pid in s.groups().values()}
        return out

    def stop(self) -> None:
        super().stop()  # the router first: nothing reaches the servers after it
        for s in self.servers:
            s.stop()


def router_program() -> str:
    found = shutil.which("vllm-router", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        raise RuntimeError(f"vllm-router is not installed: pip install '{ROUTER_PACKAGE}' "
                           "(`make setup` installs it)")
    return found
