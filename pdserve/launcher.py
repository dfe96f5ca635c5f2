"""`pdserve serve`: a controller and N prefill + M decode workers on this machine, as children.

Start: check the ports and the memory (pdserve/preflight.py) -> start the controller and the
workers, each child's output going to its own log file in a run folder (or, with --verbose, to
this terminal) -> one line per child as it comes up -> `pdserve ready: URL` and a request to
try. A child that exits during start-up ends serve with the end of its log.

Once the pool is ready, a worker that exits is restarted with a backoff and the controller
exiting ends serve (pdserve/supervisor.py). Ctrl-C / SIGTERM (and SIGHUP: cli.py) stops the
controller first (it refuses new requests and lets the streams in flight finish), then drains
the workers and stops everything (a worker waiting for its restart is not started again; a
second Ctrl-C stops everything at once) and removes the temporary files this command created;
the logs stay.
Serve gone without that (kill -9), each child stops itself as serve would have stopped it
(cli.py's SERVE_PID_ENV).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from pdserve import preflight
from pdserve.cli import SERVE_PID_ENV
from pdserve.leftovers import Leftovers, stale_temp, temp_env
from pdserve.models import BUILTIN_MODEL_NAME, cache_dir, default_model_dir, resolve_model
from pdserve.supervisor import Child, ChildExited, Supervisor, supervise

logger = logging.getLogger("pdserve.serve")

RUNS_KEPT = 20  # run folders kept under the cache (the newest)


def assign_cores(n_engines: int, cores: list[int]) -> list[str | None]:
    """The cores split evenly between the engines (the first ones get any remainder), each
    worker kept to its share; with fewer cores than engines, none: on CPU hosts the workers
    then claim a core each themselves, shared where needed (pdserve.worker.cores)."""
    if n_engines == 0 or n_engines > len(cores):
        return [None] * n_engines
    share, extra = divmod(len(cores), n_engines)
    out: list[str | None] = []
    start = 0
    for i in range(n_engines):
        mine = cores[start:start + share + (i < extra)]
        start += len(mine)
        out.append(",".join(map(str, mine)))
    return out


def controller_cores(roles: list[str], cores: list[str | None],
                     controller_args: Sequence[str] = ()) -> str | None:
    """The controller's cores: those of the prefill workers, so that its work for every streamed
    token never takes a decode engine's core, whose steps set ITL. None when no prefill worker
    has cores of its own (any core), or when the user's `controller_args` name its cores."""
    if any(a == "--cores" or a.startswith("--cores=") for a in controller_args):
        return None
    return ",".join(c for r, c in zip(roles, cores) if r == "prefill" and c is not None) or None


def controller_command(args, model: str, name: str | None, keys: str | None,
                       cores: str | None = None) -> list[str]:
    """The controller's command line; with --api-servers N it starts N API servers on --port,
    API server i taking worker port --worker-port + i; kept to `cores` if given."""
    cmd = [sys.executable, "-m", "pdserve.cli", "controller", "--model", model,
           "--host", args.host, "--port", str(args.port), "--worker-host", "127.0.0.1",
           "--worker-port", str(args.worker_port),
           # serve's own polling while it starts, not worth a line each
           "--disable-access-log-for-endpoints", "/pd/workers"]
    if args.api_servers > 1:
        cmd += ["--api-servers", str(args.api_servers)]
    if name:
        cmd += ["--served-model-name", name]
    if keys:
        cmd += ["--keys", keys]
    if cores:
        cmd += ["--cores", cores]
    return cmd + args.controller_arg


def worker_command(role: str, controller: str, model: str, cores: str | None,
                   keys: str | None, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "worker", "--role", role,
           "--controller", controller, "--model", model, "--advertise-host", "127.0.0.1"]
    if cores is not None:
        cmd += ["--cores", cores]
    if keys:
        cmd += ["--keys", keys]
    return cmd + extra


CONTROLLER_HEADER = "x-pdserve-controller"


def get_pool(base: str, timeout: float = 2.0) -> tuple[str, list[dict]]:
    """The id of the controller that answered on `base` (one of the API servers sharing the
    port) and its view of the pool."""
    with urllib.request.urlopen(base + "/pd/workers", timeout=timeout) as r:
        return r.headers.get(CONTROLLER_HEADER, ""), json.loads(r.read())


def wait_ready(base: str, expected: int, children: list[Child], timeout: float,
               stopping: Callable[[], bool] = lambda: False,
               progress: Callable[[list[dict]], None] | None = None,
               api_servers: int = 1, tick: Callable[[], None] = lambda: None) -> bool:
    """True once `expected` workers are ready in the view of `api_servers` different
    controllers answering on `base` (new connections reach each API server sharing the port in
    turn, as the kernel spreads them); False if `stopping()` turns true first. A child exiting
    now is an error, not restarted: at start-up it is most likely a wrong flag. `progress` is
    given the pool (/pd/workers) each time a controller answers; `tick` is called on each
    round."""
    deadline = time.monotonic() + timeout
    ready: set[str] = set()  # controllers that have seen every worker ready
    while time.monotonic() < deadline:
        if stopping():
            return False
        tick()
        for c in children:
            if c.proc.poll() is not None:
                raise ChildExited(f"{c.name} exited with code {c.proc.returncode} during "
                                  "start-up", c)
        try:
            controller, workers = get_pool(base)
        except OSError:
            workers = None
        if workers is not None:
            if progress is not None:
                progress(workers)
            if sum(w["state"] == "ready" for w in workers) >= expected:
                ready.add(controller)
                if len(ready) >= api_servers:
                    return True
        time.sleep(0.5 if len(ready) == 0 else 0.1)
    raise TimeoutError(f"the pool was not ready after {timeout:.0f} s")


class StartProgress:
    """One line per child as serve starts: when it starts, then when it is up (the controller
    answers) or ready (a worker is ready in the pool), with the time since serve began."""

    def __init__(self, out: TextIO, clock: Callable[[], float] = time.monotonic):
        self.out, self.clock, self.t0 = out, clock, clock()
        self.done: set[str] = set()

    def say(self, text: str) -> None:
        # A terminal that hung up: serve goes on stopping (or serving) without it.
        with contextlib.suppress(OSError):
            print(f"pdserve: {text}", file=self.out, flush=True)

    def elapsed(self) -> str:
        return f"{self.clock() - self.t0:.0f} s"

    def seen(self, workers: list[dict], children: list[Child]) -> None:
        if "controller" not in self.done:
            self.done.add("controller")
            self.say(f"controller up ({self.elapsed()})")
        ready = {w.get("pid") for w in workers if w["state"] == "ready"}
        for c in children:
            if c.name not in self.done and c.proc.pid in ready:
                self.done.add(c.name)
                self.say(f"{c.name} ready ({self.elapsed()})")


def preflight_problem(args) -> str | None:
    """What would stop this serve from starting, found before anything starts."""
    worker_ports = range(args.worker_port, args.worker_port + args.api_servers)
    if args.port in worker_ports:
        if args.api_servers == 1:
            return f"--port and --worker-port are both {args.port}: give them different ports"
        return (f"--port {args.port} is one of the worker ports of the {args.api_servers} API "
                f"servers ({worker_ports[0]}-{worker_ports[-1]}): give it another port")
    problem = preflight.port_problem(args.host, args.port, "--port")
    for port in worker_ports:
        problem = problem or preflight.port_problem("127.0.0.1", port, "--worker-port")
    if problem is None and preflight.cpu_build():
        model = args.model or str(default_model_dir())
        problem = preflight.memory_problem(args.prefill + args.decode,
                                           preflight.kv_cache_gib(args.worker_arg),
                                           preflight.weights_gib(model),
                                           preflight.available_gib(),
                                           controllers=args.api_servers)
    return problem


def run_folder(log_dir: str | None) -> Path:
    """Where this run's logs go: --log-dir, or a new dated folder under the cache, of which
    the newest RUNS_KEPT are kept."""
    if log_dir:
        path = Path(log_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path
    root = cache_dir() / "runs"
    path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path.mkdir(parents=True)
    runs = sorted(p for p in root.iterdir() if re.fullmatch(r"\d{8}-\d{6}-\d+", p.name))
    for old in runs[:-RUNS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def serve(args) -> int:
    from pdserve.transport import keygen

    problem = preflight_problem(args)
    if problem:
        print(f"pdserve serve: {problem}", file=sys.stderr)
        return 1
    model = resolve_model(args.model)
    name = args.served_model_name or (None if args.model else BUILTIN_MODEL_NAME)
    logs = None if args.verbose else run_folder(args.log_dir)
    if gone := stale_temp():
        logger.info("removed what processes killed earlier left in %s: %s",
                    tempfile.gettempdir(), ", ".join(sorted(gone)))
    tmp = tempfile.mkdtemp(prefix=f"pdserve-serve-{os.getpid()}-")
    keys = args.keys
    if keys is None and not args.no_keys:
        keys = os.path.join(tmp, "keys")
        keygen(keys)
    env = dict(os.environ, **temp_env(tmp))  # what a killed child leaves goes with the folder
    env[SERVE_PID_ENV] = str(os.getpid())

    def spawn(name: str, cmd: list[str]) -> Child:
        worker = name != "controller"
        if logs is None:
            return Child(name, subprocess.Popen(cmd, env=env, start_new_session=True,
                                                stdin=subprocess.DEVNULL), worker=worker)
        with open(logs / f"{name}.log", "ab") as log:  # a restarted child appends
            proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return Child(name, proc, logs / f"{name}.log", worker=worker)

    sup = Supervisor(spawn, leftovers=Leftovers())
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    cores = assign_cores(len(roles), sorted(os.sched_getaffinity(0)))
    ctl_cores = controller_cores(roles, cores, args.controller_arg)
    ctl = controller_command(args, model, name, keys, ctl_cores)
    signals: list[int] = []

    def on_signal(signum, _frame):
        signals.append(signum)
        if len(signals) > 1:  # again: stop at once
            for c in sup.children:
                c.signal_group(signal.SIGKILL)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    base = f"http://{args.host}:{args.port}"
    progress = StartProgress(sys.stdout)
    if logs is not None:
        progress.say(f"logs in {logs}")
    try:
        sup.start("controller", ctl, restart=False)
        apis = f", {args.api_servers} API servers" if args.api_servers > 1 else ""
        where = f", cores {ctl_cores}" if ctl_cores else ""
        progress.say(f"controller starting ({base}{apis}{where})")
        # The first API server's worker port: it names the others to the workers (siblings).
        controller_url = f"tcp://127.0.0.1:{args.worker_port}"
        counts: dict[str, int] = {}
        for role, core in zip(roles, cores):
            counts[role] = counts.get(role, 0) + 1
            child = f"{role}-{counts[role]}"
            sup.start(child, worker_command(role, controller_url, model, core, keys,
                                            args.worker_arg))
            progress.say(f"{child} loading its engine" + (f" (cores {core})" if core else ""))
        if wait_ready(base, len(roles), sup.children, args.start_timeout, lambda: bool(signals),
                      lambda workers: progress.seen(workers, sup.children), args.api_servers,
                      tick=sup.look):
            print(f"pdserve ready: {base}/v1  ({args.prefill} prefill, {args.decode} decode{apis}; "
                  f"pool at {base}/pd/workers, dashboard at {base}/pd/dashboard)", flush=True)
            print(try_it(base, name or model), flush=True)
            supervise(sup, lambda: bool(signals))
        return 0
    except ChildExited as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        if e.child is not None and e.child.log is not None:
            print(f"the end of {e.child.log}:\n{log_tail(e.child.log)}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError) as e:
        where = f"; logs in {logs}" if logs is not None else ""
        print(f"pdserve serve: {e}{where}", file=sys.stderr)
        return 1
    finally:
        t0 = time.monotonic()
        if signals:
            what = "Ctrl-C" if signals[0] == signal.SIGINT else signal.Signals(signals[0]).name
            progress.say(f"stopping ({what}): new requests are refused, the streams in flight "
                         "finish, then the workers drain; Ctrl-C again stops at once")
        sup.stop(drain_timeout=args.drain_timeout)
        shutil.rmtree(tmp, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)
        if signals:
            progress.say(f"stopped in {time.monotonic() - t0:.0f} s")


def try_it(base: str, model: str) -> str:
    """A request to copy and paste."""
    body = json.dumps({"model": model, "prompt": "def main(", "max_tokens": 16})
    return (f"  try: curl {base}/v1/completions -H 'content-type: application/json' "
            f"-d {shlex.quote(body)}\n  Ctrl-C stops everything.")
