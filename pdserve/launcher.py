"""`pdserve serve`: a controller and N prefill + M decode workers on this machine, as children.

Each child runs in its own process group (an engine's core process is a grandchild), so stopping
a child stops its whole tree. Ctrl-C / SIGTERM drains the workers, then stops everything and
removes the temporary files this command created.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

logger = logging.getLogger("pdserve.serve")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def assign_cores(n_engines: int, cores: list[int]) -> list[str | None]:
    """The cores split evenly between the engines (the first ones get any remainder), each
    worker kept to its share; with fewer cores than engines, no pinning (the OS shares)."""
    if n_engines == 0 or n_engines > len(cores):
        return [None] * n_engines
    share, extra = divmod(len(cores), n_engines)
    out, start = [], 0
    for i in range(n_engines):
        mine = cores[start:start + share + (i < extra)]
        start += len(mine)
        out.append(",".join(map(str, mine)))
    return out


def worker_command(role: str, controller: str, model: str, cores: str | None,
                   keys: str | None, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "worker", "--role", role,
           "--controller", controller, "--model", model, "--advertise-host", "127.0.0.1"]
    if cores is not None:
        cmd += ["--cores", cores]
    if keys:
        cmd += ["--keys", keys]
    return cmd + extra


def _get_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base: str, expected: int, children: list[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during start-up")
        try:
            workers = _get_json(base + "/pd/workers")
            if sum(w["state"] == "ready" for w in workers) >= expected:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the pool was not ready after {timeout:.0f} s")


def serve(args) -> int:
    from pdserve.models import ensure_model
    from pdserve.transport import keygen

    model = args.model or str(ensure_model("tiny"))
    tmp = tempfile.mkdtemp(prefix="pdserve-serve-")
    keys = args.keys
    if keys is None and not args.no_keys:
        keys = os.path.join(tmp, "keys")
        keygen(keys)
    env = dict(os.environ)
    env.setdefault("VLLM_RPC_BASE_PATH", tmp)
    children: list[Child] = []

    def spawn(name: str, cmd: list[str]) -> Child:
        c = Child(name, subprocess.Popen(cmd, env=env, start_new_session=True))
        children.append(c)
        return c

    ctl = [sys.executable, "-m", "pdserve.cli", "controller", "--model", model,
           "--host", args.host, "--port", str(args.port), "--worker-host", "127.0.0.1",
           "--worker-port", str(args.worker_port), *args.controller_arg]
    if keys:
        ctl += ["--keys", keys]
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    base = f"http://{args.host}:{args.port}"
    try:
        spawn("controller", ctl)
        controller_url = f"tcp://127.0.0.1:{args.worker_port}"
        roles = ["prefill"] * args.prefill + ["decode"] * args.decode
        cores = assign_cores(len(roles), sorted(os.sched_getaffinity(0)))
        counts: dict[str, int] = {}
        for role, core in zip(roles, cores):
            counts[role] = counts.get(role, 0) + 1
            spawn(f"{role}-{counts[role]}", worker_command(role, controller_url, model, core, keys,
                                                           args.worker_arg))
        wait_ready(base, len(roles), children, args.start_timeout)
        print(f"pdserve ready: {base}/v1  ({args.prefill} prefill, {args.decode} decode; "
              f"pool at {base}/pd/workers, dashboard at {base}/pd/dashboard)", flush=True)
        while not stopping:
            for c in children:
                if c.proc.poll() is not None:
                    logger.error("%s exited with code %s", c.name, c.proc.returncode)
                    if c.name == "controller":
                        return 1
                    children.remove(c)
                    break
            time.sleep(0.5)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 1
    finally:
        stop_children(children, drain_timeout=args.drain_timeout)
        shutil.rmtree(tmp, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)


def stop_children(children: list[Child], drain_timeout: float) -> None:
    """SIGTERM workers (they drain), then the controller; SIGKILL whatever is left."""
    workers = [c for c in children if c.name != "controller"]
    for c in workers:
        c.signal_group(signal.SIGTERM)
    _wait(workers, drain_timeout)
    for c in children:
        if c.proc.poll() is None:
            c.signal_group(signal.SIGTERM)
    _wait(children, 15)
    for c in children:
        c.signal_group(signal.SIGKILL)  # also reaps engine processes left in the group
        try:
            c.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _wait(children: list[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
