"""`pdserve` command line: serve | controller | worker | make-model | keygen | bench | plan."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys

from pdserve.worker.stop_signals import block_in_engine_process

# A worker's engine processes (spawned: they import this module first, before vLLM starts a
# thread) block SIGTERM/SIGINT in every thread they will have (worker/stop_signals.py).
block_in_engine_process()

USAGE = """usage: pdserve COMMAND [options]

commands:
  serve       controller + N prefill + M decode workers on this machine (one command)
  controller  vLLM's OpenAI server over a pool of workers
  worker      one vLLM engine in the prefill, decode or both role
  make-model  write a deterministic random Llama + tokenizer (no hub needed)
  keygen      write CurveZMQ keys for the control plane
  bench       compare disaggregated and colocated serving on this machine
  plan        recommend X:Y and placement settings from bench results (simulated)

`pdserve COMMAND --help` describes each command's options.
"""

# `pdserve serve` names itself to its children here: each stops, as serve would stop it, once
# serve is gone (kill -9 of serve, or of its terminal's process group): nobody else would.
SERVE_PID_ENV = "PDSERVE_SERVE_PID"


def stop_on_hangup() -> None:
    """A terminal that closes sends SIGHUP, whose default ends a process at once (a controller's
    streams cut, serve's children left running): it is taken as SIGTERM, each command's stop
    that finishes what is in flight, unless SIGHUP is ignored (nohup)."""
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, lambda *_: os.kill(os.getpid(), signal.SIGTERM))


STACKS_SIGNAL = signal.SIGUSR2


def stacks_on_signal() -> None:
    """`kill -USR2 PID` prints the stack of every thread of the process to its stderr (its log)
    and the process goes on: where a stuck one waits, seen without stopping it."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True)


def follow_serve(sig: int) -> None:
    """Send this process `sig` once the `pdserve serve` that started it has exited."""
    pid = os.environ.pop(SERVE_PID_ENV, "")  # not for this process's own children
    if not pid.isdigit():
        return
    from pdserve.procfs import on_parent_exit

    def stop() -> None:
        logging.getLogger("pdserve").warning(
            "pdserve serve (pid %s) is gone: stopping as it would have (%s)", pid,
            signal.Signals(sig).name)
        os.kill(os.getpid(), sig)

    if not on_parent_exit(int(pid), stop, "pdserve-follow-serve"):
        stop()  # gone already


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve serve",
                                description="Serve P/D on this machine with one command.")
    p.add_argument("--model", default=None, help="model folder (default: the built-in tiny model)")
    p.add_argument("--served-model-name", default=None,
                   help="the name requests give as \"model\" (default: \"tiny\" for the built-in "
                        "model, else the --model path, as vLLM does)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--worker-port", type=int, default=8001,
                   help="where workers register (with --api-servers N: API server i takes "
                        "this port + i; the workers are given the first and find the others)")
    p.add_argument("--api-servers", type=_positive, default=1,
                   help="controller processes sharing --port, each a whole controller over the "
                        "same workers (the controller's --api-servers)")
    p.add_argument("--keys", default=None,
                   help="use these `pdserve keygen` keys (default: fresh keys for this run)")
    p.add_argument("--no-keys", action="store_true",
                   help="do not encrypt/authenticate the control plane (on by default)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--drain-timeout", type=float, default=60.0)
    p.add_argument("--controller-arg", action="append", default=[],
                   help="extra argument for the controller (repeat), e.g. --controller-arg=--api-key=X")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra argument for every worker (repeat)")
    p.add_argument("--log-dir", default=None,
                   help="folder for the controller's and workers' logs (default: a new folder "
                        "under ~/.cache/pdserve/runs, or $PDSERVE_CACHE/runs; the newest 20 "
                        "are kept)")
    p.add_argument("--verbose", action="store_true",
                   help="print the controller's and workers' logs here instead of to files")
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    # pdserve's own handler: vLLM and uvicorn reconfigure the root logger as they start.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("pdserve")
    root.addHandler(handler)
    root.setLevel(os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))
    root.propagate = False
    if cmd in ("serve", "controller", "worker"):
        stop_on_hangup()
        stacks_on_signal()
    if cmd == "serve":
        from pdserve.launcher import serve

        return serve(_serve_parser().parse_args(rest))
    if cmd == "controller":
        from pdserve.controller.server import main as controller_main

        follow_serve(signal.SIGTERM)  # refuses new requests, finishes its streams
        controller_main(rest)
        return 0
    if cmd == "worker":
        from pdserve.worker.main import DRAIN_SIGNAL
        from pdserve.worker.main import main as worker_main

        follow_serve(DRAIN_SIGNAL)  # finishes its streams, then exits with its engine
        return worker_main(rest)
    if cmd == "make-model":
        p = argparse.ArgumentParser(prog="pdserve make-model")
        p.add_argument("dir")
        p.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
        p.add_argument("--seed", type=int, default=0)
        a = p.parse_args(rest)
        from pathlib import Path

        from pdserve.models import make_model

        print(make_model(Path(a.dir), a.preset, a.seed))
        return 0
    if cmd == "keygen":
        p = argparse.ArgumentParser(prog="pdserve keygen")
        p.add_argument("dir")
        a = p.parse_args(rest)
        from pdserve.transport import keygen

        for path in keygen(a.dir):
            print(path)
        return 0
    if cmd == "bench":
        from pdserve.bench.main import main as bench_main

        return bench_main(rest)
    if cmd == "plan":
        from pdserve.planner.plan import main as plan_main

        return plan_main(rest)
    print(f"pdserve: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
