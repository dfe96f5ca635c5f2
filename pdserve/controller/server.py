"""Serves a PDController with vLLM's own OpenAI-compatible server, plus pdserve's /pd/* routes.

This follows vLLM's `build_and_serve`, with one difference: pdserve's routes are added to the
app before it starts serving.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import uvloop
from fastapi.responses import HTMLResponse, JSONResponse

from pdserve import transport
from pdserve.controller import api_servers
from pdserve.controller.admission import limits
from pdserve.controller.client import PDController
from pdserve.controller.history import History
from pdserve.controller.metrics import Metrics
from pdserve.controller.planning import Planning
from pdserve.controller.pool import Pool
from pdserve.controller.response_start import ResponseStart, log_failures_in_one_line
from pdserve.controller.router import DECODE_POLICIES, PREFILL_POLICIES
from pdserve.controller.sequence import Settings
from pdserve.errors import Refused
from pdserve.models import BUILTIN_MODEL_NAME, resolve_model
from pdserve.net import keep_idle_connections
from pdserve.planner.capacity import Slo
from pdserve.planner.costmodel import Profile
from pdserve.planner.roles import RolePlanner
from pdserve.worker.engine import expected_info, keep_to_cores, parse_cores

logger = logging.getLogger("pdserve.controller")


def add_pd_args(parser) -> None:
    g = parser.add_argument_group("pdserve controller")
    g.add_argument("--worker-host", default=None,
                   help="address the worker port binds to (default: --host, or 0.0.0.0)")
    g.add_argument("--worker-port", type=int, default=8001,
                   help="ZMQ port workers register with (with --api-servers N: API server i "
                        "takes this port + i)")
    g.add_argument("--api-servers", type=_positive, default=1,
                   help="controller processes sharing the HTTP port, each a whole controller "
                        "over the same workers; a worker given any of their worker ports "
                        "registers with all of them")
    g.add_argument(api_servers.INDEX_FLAG, type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--cores", default=None,
                   help="keep the controller, its API servers and their threads to these CPUs, "
                        "e.g. 0 or 0-3 (default: any; `pdserve serve` gives it the prefill "
                        "workers' cores, away from the decode engines' steps)")
    g.add_argument("--keys", default=None,
                   help="folder from `pdserve keygen`: CurveZMQ-encrypt and authenticate workers")
    g.add_argument("--prefill-policy", default="kv_aware", choices=PREFILL_POLICIES,
                   help="kv_aware: fewest tokens to compute, counting what each engine holds "
                        "(its KV events) and its queue; prefix_aware: what this controller "
                        "sent where; or load only")
    g.add_argument("--decode-policy", default="kv_aware", choices=DECODE_POLICIES,
                   help="kv_aware: the worker holding the longest prefix of the request (it "
                        "reads only the KV it lacks), unless much busier than the least loaded")
    g.add_argument("--no-kv-index", action="store_true",
                   help="ignore the workers' KV events (kv_aware then routes on this "
                        "controller's own estimate of what each engine holds)")
    # 0: on the mixed workload, local prefill of short prompts cost 10-17% goodput until the
    # decode pool saturates (docs/performance.md, "The local-prefill threshold").
    g.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="prompts shorter than this many tokens are prefilled by their decode "
                        "worker, skipping the KV handoff (0: always disaggregate)")
    # 128: where a local prefill's stall of the decode worker's streams is about what a handoff
    # adds to TTFT (docs/performance.md, "The local-prefill threshold").
    g.add_argument("--skip-handoff-below", type=int, default=128,
                   help="when the chosen decode worker's engine already holds part of a prompt "
                        "(a follow-up turn, a shared prefix) and fewer than this many tokens "
                        "are left to compute, it prefills them itself: no prefill worker, no "
                        "KV handoff (0: never)")
    # On: a pool that lost its last worker of a role (drained, restarting, dead) keeps serving,
    # as colocated engines would, at the cost of steady streams meanwhile.
    g.add_argument("--no-fallback", dest="fallback", action="store_false",
                   help="when no worker of a role is left (all drained, restarting or gone), "
                        "make new requests wait for one (up to --queue-timeout, then 503) "
                        "instead of a worker of the other role serving them whole")
    g.add_argument("--first-token", choices=["prefill", "decode"], default="prefill",
                   help="prefill: stream the prefill worker's first token at once (lowest TTFT); "
                        "decode: send it with the decode worker's first output (TTFT includes "
                        "the KV handoff; no handoff pause inside the stream)")
    g.add_argument("--placement", choices=["rules", "slo"], default="rules",
                   help="rules: the decode policy picks the decode worker, then a short prompt "
                        "(--local-prefill-threshold), a cached one (--skip-handoff-below) or "
                        "an auto worker on duty both is served there whole, else the prefill "
                        "policy picks a prefill worker; slo: each request goes local or "
                        "disaggregated, and to the workers, that its predicted TTFT and the "
                        "TPOT of the streams already there best meet --slo with, from the "
                        "workers' live cost models (the route's reason says which)")
    # 100: the pause the bench counts as one ("requests with a gap >= 100 ms").
    g.add_argument("--max-stall", type=float, default=100.0, metavar="MS",
                   help="with --placement slo: no placement may pause a stream for longer (a "
                        "local prefill pauses its worker's streams, and those handed to it "
                        "meanwhile), unless every option would")
    g.add_argument("--slo", nargs="+", default=["ttft:2000", "tpot:50"], metavar="NAME:MS",
                   help="the SLO the role planner (`--role auto` workers) and --placement slo "
                        "aim at: ttft:MS tpot:MS")
    g.add_argument("--profile", default=None,
                   help="cost profile (JSON, as `pdserve plan --save-profile` writes) that "
                        "seeds the planner's cost model (default: the bench preset's on one "
                        "core)")
    g.add_argument("--plan-interval", type=float, default=5.0,
                   help="seconds between the role planner's decisions")
    g.add_argument("--plan-hold", type=float, default=30.0,
                   help="seconds a better split must stay better before a duty changes")
    g.add_argument("--plan-cooldown", type=float, default=60.0,
                   help="seconds between two duty changes")
    g.add_argument("--heartbeat-interval", type=float, default=1.0)
    g.add_argument("--missed-heartbeats", type=int, default=3,
                   help="a worker silent for this many intervals is suspect: it gets no new "
                        "requests, its running ones go on; it is dead at once if its connection "
                        "is gone")
    # A worker that sends nothing at all (not one output) for this long is not merely late: a
    # stopped or frozen process, a paused container. Its streams should not wait on it.
    g.add_argument("--move-after", type=float, default=10.0,
                   help="seconds of silence after which a worker whose connection is still up "
                        "is stalled: its requests move to other workers (those of its KV too), "
                        "it gets none until heard from again")
    # Long: a worker on overcommitted cores can be alive and busy yet silent for seconds, and a
    # dead verdict makes it abort everything and register again (docs/architecture.md, "A
    # worker dies").
    g.add_argument("--dead-after", type=float, default=30.0,
                   help="seconds of silence after which a worker whose connection is still up "
                        "is dead (a hung process, or a host gone without closing it); workers "
                        "give up on a controller silent for as long")
    # Long enough for a burst within the line's caps to drain: the door cannot estimate the
    # wait before any request has finished, and a waiter that times out has waited in vain.
    g.add_argument("--queue-timeout", type=float, default=60.0,
                   help="seconds a request waits for an admission slot, and for a worker of a "
                        "needed role")
    # Bounded by default: the controller's memory must not grow with the offered load.
    g.add_argument("--max-inflight", type=int, default=512,
                   help="sequences running at once (a request with n > 1 counts n); more wait "
                        "in line. Never more than the ready decode workers run at once (their "
                        "engines' --max-num-seqs summed, as they report it); raise it for a pool "
                        "whose decode engines run more than 512 together")
    g.add_argument("--max-queued", type=int, default=1024,
                   help="sequences waiting in line (FIFO, each up to --queue-timeout) for a "
                        "slot; when the line is full, or would not clear within half of "
                        "--queue-timeout, a request is refused at once with 429 and "
                        "Retry-After. 0: no line. With --max-inflight this bounds the "
                        "controller's memory at any load. vLLM's --max-num-queued-reqs, if "
                        "set, caps running + waiting as well")
    g.add_argument("--prefill-timeout", type=float, default=300.0,
                   help="seconds a prefill waits for its result, counted from when it was sent "
                        "or from the last prefill sent before it to the same worker that came "
                        "out (a long line on a busy worker is not a timeout)")
    g.add_argument("--token-timeout", type=float, default=60.0,
                   help="seconds allowed for the KV handoff + first decode token, and between "
                        "later tokens")
    g.add_argument("--max-retries", type=int, default=2,
                   help="failed legs per sequence that are retried or migrated")
    g.add_argument("--dashboard-interval", type=_sample_interval, default=5.0,
                   help="seconds between the samples /pd/dashboard charts (1 to 60); it keeps "
                        "an hour of them in memory (controller/history.py states the bound)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def _sample_interval(text: str) -> float:
    value = float(text)
    if not 1.0 <= value <= 60.0:
        raise argparse.ArgumentTypeError(f"must be 1 to 60 seconds, not {text}")
    return value


def make_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(
        prog="pdserve controller",
        description="pdserve controller: vLLM's OpenAI server over a pool of P/D workers"))
    add_pd_args(parser)
    # Users should see the KV handoff: cached_tokens in usage is on unless turned off.
    # A stopping controller lets its streams finish (25 s: within Kubernetes' default grace).
    parser.set_defaults(enable_prompt_tokens_details=True, port=8000, model=None,
                        shutdown_timeout=25)
    return parser


def settings_from(args) -> Settings:
    max_inflight, max_queued = limits(args.max_inflight, args.max_queued,
                                      getattr(args, "max_num_queued_reqs", None))
    return Settings(prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
                    local_prefill_threshold=args.local_prefill_threshold,
                    skip_handoff_below=args.skip_handoff_below,
                    fallback=args.fallback,
                    queue_timeout=args.queue_timeout, prefill_timeout=args.prefill_timeout,
                    token_timeout=args.token_timeout, max_retries=args.max_retries,
                    first_token=args.first_token, max_inflight=max_inflight,
                    max_queued=max_queued)


def planning_from(args, pool: Pool) -> Planning:
    """The role planner for this controller's `--role auto` workers (idle without them)."""
    profile = Profile.from_json(Path(args.profile).read_text()) if args.profile else Profile()
    planner = RolePlanner(Slo.parse(args.slo), hold_seconds=args.plan_hold,
                          cooldown_seconds=args.plan_cooldown,
                          handoff_in_ttft=args.first_token == "decode")
    return Planning(pool.registry, planner, profile, interval=args.plan_interval)


def controller_config(args):
    """The VllmConfig a worker on the same model would have (no engine is started)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from pdserve.worker.engine import is_cpu_host, resolve_dtype

    args.dtype = resolve_dtype(args.dtype, is_cpu_host())
    engine_args = AsyncEngineArgs.from_cli_args(args)
    return engine_args.create_engine_config()


def add_routes(app, controller: PDController, metrics: Metrics,
               history: History | None = None) -> None:
    from pdserve.controller.dashboard import DASHBOARD_HTML, recent_stats

    @app.get("/pd/workers")
    async def pd_workers():
        return JSONResponse(controller.pool.snapshot())

    @app.get("/pd/stats")
    async def pd_stats():
        return JSONResponse(recent_stats(metrics, controller))

    @app.get("/pd/dashboard")
    async def pd_dashboard():
        return HTMLResponse(DASHBOARD_HTML)

    if history is not None:
        @app.get("/pd/history")
        async def pd_history(window: float = 300.0):
            return JSONResponse(history.view(window))

    # add_middleware refuses once build_app has built the stack; add_retry_after rebuilds it.
    from starlette.middleware import Middleware

    app.user_middleware.insert(0, Middleware(ResponseStart, controller_id=controller.pool.id))
    add_retry_after(app)
    log_failures_in_one_line()


def add_retry_after(app) -> None:
    """Admission refusals (429, 503) as vLLM's error body, plus the Retry-After header that
    vLLM's own error response has no room for."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    # More specific than vLLM's VLLMError handler, so Starlette picks this one.
    @app.exception_handler(Refused)
    async def refused(request, exc: Refused):
        err = create_error_response(exc)
        return JSONResponse(err.model_dump(), status_code=err.error.code,
                            headers={"Retry-After": str(exc.retry_after)})

    # Starlette copies the handlers when it builds the middleware stack, and build_app has
    # built it already (its SageMaker bootstrap does): build it again, as that bootstrap does.
    if app.middleware_stack is not None:
        app.middleware_stack = app.build_middleware_stack()


async def serve(args: argparse.Namespace) -> None:
    import prometheus_client
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm import envs
    from vllm.entrypoints.launchers.launcher import serve_http
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    vllm_config = controller_config(args)
    keys = transport.Keys.load(args.keys) if args.keys else None
    worker_host = args.worker_host or args.host or "0.0.0.0"
    worker_port, siblings = api_servers.worker_ports(args.worker_port, args.api_servers,
                                                     args.api_server_index or 0)
    pool = Pool(f"tcp://{worker_host}:{worker_port}", expected=expected_info(vllm_config),
                keys=keys, heartbeat_interval=args.heartbeat_interval,
                missed_heartbeats=args.missed_heartbeats, move_after=args.move_after,
                dead_after=args.dead_after, siblings=siblings, kv_index=not args.no_kv_index)
    metrics = Metrics()
    metrics.watch_pool(pool.registry)
    registry = get_prometheus_registry()
    if registry is prometheus_client.REGISTRY:
        registry.register(metrics.registry)
    history = History(metrics, interval=args.dashboard_interval)
    pool.watch(history.worker_event)
    pool.start()
    sampler = asyncio.create_task(history.run())
    controller = PDController(vllm_config, pool, settings_from(args), metrics)
    planning = planning_from(args, pool)
    metrics.watch_planning(planning)
    if args.placement == "slo":
        controller.placer = planning
        planning.max_stall_s = args.max_stall / 1e3
    planner_task = asyncio.create_task(planning.run(pool.changed))
    logger.info("pdserve controller %s: workers register at %s%s", pool.id, pool.address,
                " (CurveZMQ)" if keys else "")

    listen_address, sock = http_socket(args)
    supported_tasks = await controller.get_supported_tasks()
    app = build_app(args, supported_tasks, controller.model_config)
    add_routes(app, controller, metrics, history)
    await init_app_state(controller, app.state, args, supported_tasks)
    logger.info("pdserve controller serving on %s", listen_address)
    # vLLM's --log-config-file and --disable-access-log-for-endpoints, as its own server
    log_config = get_uvicorn_log_config(args)
    # Before serve_http, which returns only once the server has stopped: the shutdown (vLLM's
    # signal handler -> controller.shutdown) runs while it serves.
    controller.on_closing = lambda: stop_listening(app)
    try:
        shutdown_task = await serve_http(
            app, sock=sock, enable_ssl_refresh=args.enable_ssl_refresh, host=args.host,
            port=args.port, log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers, timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            **({"log_config": log_config} if log_config else {}))
        _enable_pdserve_loggers()
        await shutdown_task
    finally:
        sampler.cancel()
        planner_task.cancel()
        controller.shutdown()
        await pool.close()
        sock.close()


def http_socket(args) -> tuple[str, socket.socket]:
    """vLLM's listening socket, whose connections send each streamed chunk at once.

    asyncio sets TCP_NODELAY on a connection only when its socket names its protocol, which
    vLLM's listening socket does not; accepted connections inherit it from the listener.
    Without it, on a keep-alive connection (most clients) Nagle holds a chunk until the client
    ACKs the last one, which it delays by up to 40 ms: the first token and bursts of later ones
    arrived tens of milliseconds late."""
    from vllm.entrypoints.launchers.launcher import setup_server

    listen_address, sock = setup_server(args, reuse_port=args.api_servers > 1)
    if sock.family in (socket.AF_INET, socket.AF_INET6):  # not a Unix socket (--uds)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return listen_address, sock


def stop_listening(app) -> None:
    """Close the listening socket(s), not the connections: streams in flight go on, and new
    connections go to the other API servers sharing the port (SO_REUSEPORT), or are refused."""
    for server in getattr(getattr(app.state, "server", None), "servers", ()):
        server.close()


def _enable_pdserve_loggers() -> None:
    # uvicorn's logging set-up (dictConfig) disables loggers that exist before it runs; pdserve's
    # request and pool logs are what explain the P/D path, so they are turned back on.
    for name, lg in logging.root.manager.loggerDict.items():
        if name.startswith("pdserve") and isinstance(lg, logging.Logger):
            lg.disabled = False


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    keep_idle_connections(os.environ)  # read by vLLM's server as it starts; API servers inherit
    parser = make_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) and not args.model:
        args.model = args.model_tag
    if not args.model:
        args.model = resolve_model(None)
        args.served_model_name = args.served_model_name or [BUILTIN_MODEL_NAME]
    validate_parsed_serve_args(args)
    try:
        settings_from(args)
    except ValueError as e:
        parser.error(str(e))
    if args.cores:  # before the API servers and the server's threads start: they inherit it
        try:
            keep_to_cores(parse_cores(args.cores))
        except (ValueError, OSError) as e:
            parser.error(f"--cores {args.cores}: {e}")
    if args.api_servers > 1 and args.api_server_index is None:
        raise SystemExit(api_servers.run(sys.argv[2:] if argv is None else list(argv),
                                         args.api_servers,
                                         args.shutdown_timeout))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        uvloop.run(serve(args))  # the event loop vLLM's own server runs on
    except KeyboardInterrupt:
        pass
