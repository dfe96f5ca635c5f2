"""`pdserve worker`: build the engine for a role, register with the controller(s), serve.

SIGTERM or SIGINT drains (finish in-flight requests, unregister, exit), also when the whole process
group gets it (Ctrl-C in a terminal, `kill -- -PGID`) or every process of the unit does
(systemd's default stop): the engine's processes keep to a group of their own and take those
signals only from the process that runs them (worker/engine_proc.py), so they stop when the
worker stops them. A second signal stops at once; the controller then moves the streams in
flight to other workers. SIGUSR1 (what `pdserve serve` sends) drains and is never a second.
Any of them while the engine is starting stops the engine, and the worker exits once its
processes are gone.

Exit codes: 0 stopped or drained; 3 refused by every controller (wrong model or settings: a
restart would be refused again); 4 the engine died (restart the worker).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from pdserve import transport
from pdserve.leftovers import temp_env
from pdserve.models import resolve_model
from pdserve.net import free_port
from pdserve.preflight import port_problem
from pdserve.protocol import Role
from pdserve.worker.discovery import Discovery, read_list
from pdserve.worker import cores as claims  # `cores` names the --cores lists here

if TYPE_CHECKING:
    from pdserve.worker.worker import PDWorker

logger = logging.getLogger("pdserve.worker")


def make_parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="pdserve worker",
                                    description="A vLLM engine serving one P/D role")
    g = parser.add_argument_group("pdserve worker")
    g.add_argument("--role", required=True, choices=[r.label for r in Role])
    g.add_argument("--controller", action="append", default=[], metavar="tcp://HOST:PORT",
                   help="controller worker port; repeat to serve several controllers. A HOST "
                        "name is looked up again every --discovery-interval and every address "
                        "it has is a controller (e.g. a Kubernetes headless Service)")
    g.add_argument("--controllers-file", action="append", default=[], metavar="PATH",
                   help="a file of controller URLs, one per line, read again every "
                        "--discovery-interval: controllers added are registered with, "
                        "controllers removed finish their requests here and are left")
    g.add_argument("--discovery-interval", type=float, default=None,
                   help="seconds between lookups of the controller set (default: the "
                        "heartbeat interval)")
    g.add_argument("--worker-id", default=None, help="stable id (default: role + random)")
    g.add_argument("--advertise-host", default=None,
                   help="address peers use to reach this worker's KV side channel (default: "
                        "the local address that routes to the first controller)")
    g.add_argument("--kv-port", type=int, default=0,
                   help="NIXL side-channel port (default: a free port)")
    g.add_argument("--cores", default=None,
                   help="CPU cores for this worker and its engine (CPU hosts), e.g. 0, 0-3 or "
                        "0,2-3; the engine binds one compute thread per core (default on CPU "
                        "hosts: a core no other pdserve worker here holds, else the "
                        "least-claimed one, shared)")
    g.add_argument("--front-cores", default=None,
                   help="CPU cores for this worker's own process once its engine has started "
                        "(default: where --cores put it); its engine keeps --cores. The worker "
                        "relays every output of its engine: on cores no engine computes on, "
                        "that relay no longer takes turns with the engine's steps")
    g.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache size on CPU hosts")
    g.add_argument("--no-kv-events", action="store_true",
                   help="do not publish the engine's prefix-cache events to the controllers "
                        "(they then route on their own estimate of what it holds)")
    g.add_argument("--keys", default=None, help="folder from `pdserve keygen` (CurveZMQ)")
    g.add_argument("--health-port", type=int, default=0,
                   help="serve GET /health here (200 once registered), for probes")
    g.add_argument("--heartbeat-interval", type=float, default=1.0)
    g.add_argument("--drain-timeout", type=float, default=600.0,
                   help="seconds a draining worker waits for in-flight requests")
    g.add_argument("--engine-hung-after", type=float, default=300.0, metavar="SECONDS",
                   help="an engine that has not stepped for this long (stopped or hung; its "
                        "requests moved elsewhere after --move-after) is taken for dead: the "
                        "worker exits with code 4 so that it is started again; 0: never")
    # vLLM's engine flags with vLLM's defaults: a compiled model (CUDA graphs on a GPU), as a
    # plain `vllm serve` runs it; --enforce-eager starts faster and decodes slower.
    parser = AsyncEngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)
    return parser


def _first_controller(args) -> str:
    """A controller URL to pick this host's advertised address by (the first one named)."""
    if args.controller:
        return args.controller[0]
    try:
        return read_list(Path(args.controllers_file[0]).read_text())[0]
    except (OSError, IndexError, ValueError):
        return "tcp://127.0.0.1:0"  # not readable yet: pass --advertise-host


def route_address(controller_url: str) -> str:
    """The local address this host uses to reach the controller (what peers can reach too)."""
    host = urlparse(controller_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


async def _health_server(port: int, worker, host: str = "0.0.0.0") -> asyncio.AbstractServer:
    """GET /health: 200 once registered and not draining (for probes). GET /metrics: the
    engine's own Prometheus series (vLLM's `vllm:` metrics), for scraping."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    async def handle(reader, writer):
        try:
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
            ctype = b"text/plain"
            if head.split(b" ", 2)[1:2] == [b"/metrics"]:
                status, ctype, body = b"200 OK", CONTENT_TYPE_LATEST.encode(), generate_latest()
            elif any(lk.registered for lk in worker.links.values()) and not worker.draining:
                status, body = b"200 OK", b"ok\n"
            else:
                status, body = b"503 Service Unavailable", b"not registered or draining\n"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\n"
                         b"Content-Length: " + str(len(body)).encode() +
                         b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


async def run(args, starting: StartSignals) -> int:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from pdserve.worker.engine import EngineSettings, VllmEngine
    from pdserve.worker.worker import PDWorker

    role = Role[args.role.upper()]
    discovery = Discovery(args.controller, args.controllers_file)
    host = args.advertise_host or route_address(_first_controller(args))
    if args.kv_port and (problem := port_problem(host, args.kv_port, "--kv-port")):
        logger.error("%s", problem)  # now, not when the engine binds it ~30 s from here
        return 2
    kv_port = args.kv_port or free_port(host)
    settings = EngineSettings(role, advertise_host=host, kv_port=kv_port, cores=args.cores,
                              kv_cache_gib=args.kv_cache_gib, kv_events=not args.no_kv_events)
    keys = transport.Keys.load(args.keys) if args.keys else None
    engine = None
    try:
        engine = VllmEngine(settings, AsyncEngineArgs.from_cli_args(args))
        worker = PDWorker(engine, role, discovery, worker_id=args.worker_id, address=host,
                          kv_port=kv_port, keys=keys, heartbeat_interval=args.heartbeat_interval,
                          drain_timeout=args.drain_timeout,
                          engine_hung_after=args.engine_hung_after,
                          discovery_interval=args.discovery_interval)
        stop_on_signals(worker)
        if args.front_cores is not None:
            move_front(args.front_cores)
    except StoppedDuringStart as e:
        logger.warning("%s while the engine was starting: stopping it", e)
        if engine is not None:
            engine.shutdown()
        stop_engine_processes(starting)
        return 0
    freeze_startup_heap()
    health = await _health_server(args.health_port, worker) if args.health_port else None
    logger.info("worker %s (%s) up: KV side channel %s:%d, controllers %s", worker.worker_id,
                args.role, host, kv_port,
                ", ".join(args.controller + [f"listed in {f}" for f in args.controllers_file]))
    try:
        await worker.run()
    finally:
        if health is not None:
            health.close()
        engine.shutdown()
    return exit_code(worker)


def freeze_startup_heap() -> None:
    """Leave what the worker holds once started (torch, vLLM, the engine's client: ~600k
    objects) out of the garbage collector's full collections, as vLLM's API server does before it
    serves. A worker has no API server: unfrozen, each full collection walked that heap for
    0.3-0.6 s with the event loop stopped, and every stream on the worker paused that long."""
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()


EXIT_REFUSED = 3
EXIT_ENGINE_DEAD = 4


def exit_code(worker: PDWorker) -> int:
    """How a worker that has stopped exits (see the module docstring)."""
    if worker.engine_dead:
        return EXIT_ENGINE_DEAD
    return EXIT_REFUSED if worker.refused_by_all else 0


# What `pdserve serve` sends its workers to stop them: it drains and never counts as a second
# signal. systemd's stop of a unit signals every process of it, so a worker under serve gets
# systemd's SIGTERM too; had serve passed on a SIGTERM as well, the two would have been "again".
DRAIN_SIGNAL = signal.SIGUSR1


class StoppedDuringStart(BaseException):
    """A stop signal came while the engine was starting (a BaseException, as KeyboardInterrupt
    is: vLLM's start must not catch it as one of its own errors)."""


class StartSignals:
    """Stop signals before stop_on_signals takes over. The first ends the engine's start
    (StoppedDuringStart); later ones are counted as stop_on_signals counts them. Left to their
    defaults, SIGTERM and SIGUSR1 killed the worker at once and its engine core (in a group of
    its own, engine_proc.py) went on starting, orphaned, until its watcher stopped it: `pdserve
    serve` said "stopped" while an engine was still there."""

    def __init__(self) -> None:
        self.signals: list[int] = []

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, DRAIN_SIGNAL):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        self.signals.append(signum)
        if len(self.signals) == 1:
            raise StoppedDuringStart(signal.Signals(signum).name)

    @property
    def again(self) -> bool:
        """A second SIGTERM or SIGINT: stop at once (DRAIN_SIGNAL is never a second)."""
        return sum(s != DRAIN_SIGNAL for s in self.signals) >= 2


# How long an engine core that was starting has, after its SIGTERM, to finish its start and
# shut down (vLLM's handler only marks a starting engine for shutdown) before it is killed.
START_STOP_GRACE_S = 30.0


def stop_engine_processes(starting: StartSignals, grace: float = START_STOP_GRACE_S) -> None:
    """Stop the engine core this worker was starting, with its model runners (its process
    group), and wait until they are gone: at most `grace` seconds, or until a second SIGTERM
    or SIGINT."""
    import multiprocessing
    import time

    from pdserve.worker import engine_proc

    cores = [p for p in multiprocessing.active_children() if p.pid is not None]
    for p in cores:
        p.terminate()  # SIGTERM, which an engine core takes from its worker
    deadline = time.monotonic() + grace
    while (any(p.is_alive() for p in cores) and time.monotonic() < deadline
           and not starting.again):
        time.sleep(0.1)
    for p in cores:
        if p.is_alive() and p.pid is not None:
            logger.warning("engine core %d did not stop %s: killing it", p.pid,
                           "before a second signal" if starting.again else f"within {grace:g} s")
            engine_proc.kill(p.pid)
            p.join(5)


def stop_on_signals(worker: PDWorker) -> None:
    """SIGTERM or SIGINT drains; a second one stops at once. DRAIN_SIGNAL drains only."""
    signals = []

    def drain(why: str) -> None:
        if not worker.draining:
            logger.info("%s: draining (SIGTERM or SIGINT again stops at once)", why)
            asyncio.ensure_future(worker.drain())

    def on_signal(signum: int) -> None:
        signals.append(signum)
        name = signal.Signals(signum).name
        if len(signals) == 1:
            drain(name)
        else:
            logger.warning("%s again: stopping now; the controller moves the streams in flight",
                           name)
            worker.stop()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(DRAIN_SIGNAL, drain, f"{DRAIN_SIGNAL.name} (the launcher's stop)")


def pin(cores: str) -> None:
    """Keep the whole worker on its cores: this process and, by inheritance, its engine's
    processes. vLLM binds only the model runner's compute threads; left free, the engine's
    scheduler and this process's output handling ran on the other engine's core and stalled
    it (measured: decode streams paused 0.1-0.8 s whenever the prefill engine computed)."""
    from pdserve.worker.engine import keep_to_cores, parse_cores

    try:
        keep_to_cores(parse_cores(cores))
    except (ValueError, OSError) as e:
        raise SystemExit(f"pdserve worker: --cores {cores}: {e}") from None


def check_front_cores(cores: str) -> None:
    """--front-cores is applied once the engine has started (~45 s on): say now what is wrong
    with it, while this process may still use every core it was given."""
    from pdserve.worker.engine import cpu_list, parse_cores

    try:
        wanted = parse_cores(cores)
    except ValueError as e:
        raise SystemExit(f"pdserve worker: --front-cores {cores}: {e}") from None
    usable = os.sched_getaffinity(0)
    if not wanted & usable:
        raise SystemExit(f"pdserve worker: --front-cores {cores}: none of these is a core this "
                         f"process may use (it may use {cpu_list(usable)})")


def move_front(cores: str) -> None:
    """Move this process's threads (not its engine's processes, which keep --cores) to
    --front-cores. Threads started later inherit the mask of the thread starting them."""
    from pdserve.worker.engine import keep_to_cores, parse_cores

    try:
        keep_to_cores(parse_cores(cores))
    except (ValueError, OSError) as e:  # checked at the start: the host's cores changed since
        logger.warning("--front-cores %s: %s; this process stays on its engine's cores", cores, e)
        return
    logger.info("this worker's own process is on cores %s; its engine keeps its own", cores)


def claim_cores(given: str | None) -> claims.Claim | None:
    """On a CPU host, this worker's claim on its cores (see pdserve.worker.cores): the --cores
    given, recorded so that workers claiming by themselves keep off them; else one core no
    other pdserve worker on this host holds or, when none is free, the least-claimed one,
    shared (its engine then binds one compute thread: engines bound to all cores beside other
    engines were seen to hang for minutes after loading their weights). None on other hosts."""
    from pdserve.worker.engine import cpu_list, is_cpu_host, parse_cores

    if not is_cpu_host():  # cheap here: make_parser() has imported vLLM already
        return None
    if given is not None:
        try:
            held = claims.hold(parse_cores(given))
        except ValueError:
            return None  # pin() says what is wrong with the list
        except OSError as e:
            logger.warning("cannot record --cores %s in %s: %s; workers started without --cores "
                           "may take them too", given, claims.lock_dir(), e)
            return None
        if held.others:
            logger.warning("--cores %s: also held by %d other pdserve worker(s) on this host",
                           given, held.others)
        return held
    try:
        claim = claims.claim()
    except OSError as e:
        raise SystemExit(f"pdserve worker: cannot claim a core in {claims.lock_dir()}: {e}; "
                         f"pass --cores, or set {claims.LOCK_DIR_ENV} to a folder that every "
                         "worker on this host can write") from None
    if claim.others:
        logger.info("no --cores and no core free among %s: sharing core %s with %d other "
                    "pdserve worker(s), one compute thread", cpu_list(os.sched_getaffinity(0)),
                    claim.spec, claim.others)
    else:
        logger.info("no --cores: took core %s, which no other pdserve worker on this host holds",
                    claim.spec)
    return claim


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        Discovery(args.controller, args.controllers_file)
    except ValueError as e:  # no controller, or a bad URL
        parser.error(str(e))
    if args.front_cores is not None:
        check_front_cores(args.front_cores)
    claim = claim_cores(args.cores)  # held until this process ends
    if args.cores is None and claim is not None:
        args.cores = claim.spec  # as if given: pinned, and the engine binds one thread per core
    if args.cores is not None:
        pin(args.cores)
    args.model = resolve_model(args.model)
    starting = StartSignals()
    starting.install()
    folder = own_temp_folder()
    try:
        return asyncio.run(run(args, starting))
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def own_temp_folder() -> str | None:
    """A worker started on its own keeps its temporary files in a folder that goes when it
    exits: vLLM leaves its IPC sockets (three per engine) and its file store in the temporary
    folder even after a clean stop, as a plain `vllm serve` does (seven sockets). A worker
    killed with SIGKILL leaves the folder, named by its pid, to the next `pdserve serve`
    (leftovers.stale_temp). None, and nothing moved, under `pdserve serve` (which gives its
    children a folder) or where the user placed vLLM's sockets."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return None
    try:
        folder = tempfile.mkdtemp(prefix=f"pdserve-worker-{os.getpid()}-")
    except OSError as e:  # vLLM puts its sockets in the temporary folder all the same
        logger.warning("no temporary folder of this worker's own (%s): its engine's sockets go "
                       "in %s and stay there after it stops", e, tempfile.gettempdir())
        return None
    os.environ.update(temp_env(folder))  # before the engine's processes start: they inherit it
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    return folder
