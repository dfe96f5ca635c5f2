"""`pdserve bench overhead`: what pdserve's front end costs.

(a) latency: one engine on one core, served by vLLM's plain OpenAI server and then through pdserve
    (controller + one worker of role `both`, every request prefilled locally), under low load
    (one request at a time by default); TTFT, TPOT, ITL and E2E of the same requests.
(b) throughput: the controller with fake workers (pdserve.fake) that produce tokens instantly,
    at rising concurrency: output tokens/s streamed to the client and controller CPU per token.
(c) cost per token against vLLM's own server: the same fake engine, paced at the same rate
    (`--c-decode-delay` between a request's tokens), first in-process behind vLLM's OpenAI
    server (bench/inproc.py), then in fake workers behind pdserve's controller; the same trace
    and client, back to back, in rounds that alternate the order; server CPU per streamed token,
    tokens per SSE chunk, and the ratio to vLLM's server in the same round.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench import cluster, metrics, procs, report, workload
from pdserve.bench.client import ClientRun, run_client, run_measured
from pdserve.models import resolve_model
from pdserve.worker.engine import parse_cores

logger = logging.getLogger("pdserve.bench.overhead")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench overhead", description=__doc__.split("\n")[0])
    p.add_argument("--part", default="all", choices=["a", "b", "c", "all"])
    p.add_argument("--model", default=None, help="model folder (default: the `bench` preset)")
    p.add_argument("--preset", default="bench")
    p.add_argument("--out", default=None, help="default: bench-results/overhead-<timestamp>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--core", default="0", help="(a) the core the engine is pinned to")
    p.add_argument("--a-prompts", type=int, default=40)
    p.add_argument("--a-input-len", type=int, default=256)
    p.add_argument("--a-output-len", type=int, default=128)
    p.add_argument("--a-concurrency", type=int, default=1, help="(a) requests in flight")
    p.add_argument("--b-concurrency", default="8,32,128",
                   help="(b) requests in flight, comma-separated levels")
    p.add_argument("--b-output-len", type=int, default=512)
    p.add_argument("--b-input-len", type=int, default=32)
    p.add_argument("--b-configs", default="both1,1P1D",
                   help="(b) fake pools: bothN (local prefill) and/or XpYd")
    p.add_argument("--b-keys", default="on,off", help="(b) CurveZMQ on the control plane")
    p.add_argument("--c-concurrency", default="32",
                   help="(c) requests in flight, comma-separated levels")
    p.add_argument("--c-decode-delay", type=float, default=0.01,
                   help="(c) seconds between a request's tokens, in every fake engine")
    p.add_argument("--c-output-len", type=int, default=256)
    p.add_argument("--c-input-len", type=int, default=32)
    p.add_argument("--c-configs", default="both1,1P1D",
                   help="(c) pdserve's fake pools (bothN and/or XpYd), CurveZMQ on")
    p.add_argument("--c-rounds", type=int, default=2,
                   help="(c) each server once per round, the order reversed every other round")
    p.add_argument("--no-keys", action="store_true", help="(a) control plane without CurveZMQ")
    procs.add_start_and_quiet_args(p)
    return p


def _trace(out: Path, name: str, n: int, input_len: int, output_len: int, seed: int,
           run: int) -> Path:
    items = workload.make_workload(workload.uniform(input_len, output_len), n, float("inf"), 1.0,
                                   seed)
    return workload.write_trace(items, out / "raw" / f"{name}.jsonl", run=run)


def _latency_run(dep: cluster.Deployment, name: str, model: str, out: Path,
                 args: argparse.Namespace) -> dict[str, Any]:
    url = dep.start(args.start_timeout)
    log = dep.logdir / "client.log"
    warm = _trace(out, f"{name}-warmup", 4, args.a_input_len, args.a_output_len, args.seed, 98)
    run_client(ClientRun(url, model, warm, 4, out / "raw" / f"{name}-warmup.json", metrics.Slo(),
                         max_concurrency=args.a_concurrency), log, args.seed)
    trace = _trace(out, "a", args.a_prompts, args.a_input_len, args.a_output_len, args.seed, 0)
    procs.wait_quiet(args.quiet_below, args.quiet_timeout)
    run = run_measured(ClientRun(url, model, trace, args.a_prompts, out / "raw" / f"{name}.json",
                                 metrics.Slo(), max_concurrency=args.a_concurrency),
                       dep.groups(), log, args.seed)
    recs = metrics.records_from_vllm(run.pop("result"))
    tokens = sum(r.output_len for r in recs if r.ok)
    mine = {k: v for k, v in run["cpu"].items() if k not in ("machine", "others")}
    return {"summary": metrics.summarize(recs, run["duration"], metrics.Slo()),
            "cpu": run["cpu"], "cpu_ms_per_token": {
                k: round(1e3 * v["cpu_s"] / max(tokens, 1), 3) for k, v in mine.items()}}


def part_a(args: argparse.Namespace, model: str, out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"workload": f"{args.a_prompts} requests, {args.a_input_len} prompt "
                           f"tokens, {args.a_output_len} out, {args.a_concurrency} in flight"}
    with cluster.VllmDeployment(model, out, core=args.core) as dep:
        res["vllm"] = _latency_run(dep, "vllm", model, out, args)
    pd = cluster.Config("pdserve", both=1)
    # The worker (and its engine) on the same core as vLLM's server; the controller runs free,
    # as it would on its own host.
    with cluster.PdDeployment(pd, model, out, keys=not args.no_keys,
                              cores=sorted(parse_cores(args.core))) as dep:
        res["pdserve"] = _latency_run(dep, "pdserve", model, out, args)
    return res


def fake_worker_cmd(model: str, decode_delay: float = 0.0) -> cluster.WorkerCmd:
    def cmd(role: str, controller: str, core: str | None, keys: str | None) -> list[str]:
        c = [sys.executable, "-m", "pdserve.fake", "worker", "--role", role, "--controller",
             controller, "--model", model, "--decode-delay", str(decode_delay)]
        return c + (["--keys", keys] if keys else [])
    return cmd


def fake_pool(spec: str) -> cluster.Config:
    """`bothN` (N workers of role both, every prompt local) or `XpYd`."""
    if spec.startswith("both"):
        return cluster.Config(f"fake-{spec}", both=int(spec[4:] or 1))
    x = cluster.parse_configs(spec)[0]
    return cluster.Config(f"fake-{x.name}", prefill=x.prefill, decode=x.decode)


def part_b(args: argparse.Namespace, model: str, out: Path, rows: list[dict[str, Any]],
           saved: Callable[[], None]) -> None:
    levels = [int(c) for c in args.b_concurrency.split(",") if c.strip()]
    for spec in [s.strip() for s in args.b_configs.split(",") if s.strip()]:
        cfg = fake_pool(spec)
        for keys in [k.strip() == "on" for k in args.b_keys.split(",") if k.strip()]:
            name = f"{cfg.name}-{'keys' if keys else 'nokeys'}"
            with cluster.PdDeployment(cluster.Config(name, cfg.prefill, cfg.decode, cfg.both),
                                      model, out, keys=keys,
                                      worker_cmd=fake_worker_cmd(model)) as dep:
                url = dep.start(args.start_timeout)
                for i, c in enumerate(levels):
                    n = 2 * c
                    trace = _trace(out, f"b-{name}-c{c}", n, args.b_input_len, args.b_output_len,
                                   args.seed, i)
                    procs.wait_quiet(args.quiet_below, args.quiet_timeout)
                    run = run_measured(ClientRun(url, model, trace, n,
                                                 out / "raw" / f"b-{name}-c{c}.json",
                                                 metrics.Slo(), max_concurrency=c),
                                       dep.groups(), dep.logdir / "client.log", args.seed)
                    rows.append(_throughput_row(cfg.name, keys, c, run))
                    logger.info("%s concurrency %d: %.0f tokens/s", name, c,
                                rows[-1]["output_tok_s"])
                    saved()


def _throughput_row(name: str, keys: bool, concurrency: int, run: dict[str, Any]
                    ) -> dict[str, Any]:
    result = run.pop("result")
    recs = metrics.records_from_vllm(result)
    s = metrics.summarize(recs, run["duration"], metrics.Slo())
    tokens = sum(r.output_len for r in recs if r.ok)
    ctl = run["cpu"]["controller"]
    workers = sum(v["cpu_s"] for k, v in run["cpu"].items()
                  if k not in ("controller", "machine", "others", "client"))
    return {"config": name, "keys": keys, "concurrency": concurrency, "tokens": tokens,
            "failed": s["failed"], "output_tok_s": s["output_throughput"],
            "controller_core_pct": ctl["core_pct"],
            "controller_us_per_token": round(1e6 * ctl["cpu_s"] / max(tokens, 1), 1),
            "workers_core_pct": round(100.0 * workers / run["duration"], 1),
            "client_core_pct": run["cpu"]["client"]["core_pct"],
            "others_core_pct": run["cpu"]["others"]["core_pct"],
            "ttft_p50_ms": s["ttft"]["p50"], "itl_p99_ms": s["itl"]["p99"]}


class InprocDeployment(cluster.VllmDeployment):
    """vLLM's OpenAI server over an in-process fake engine (bench/inproc.py), not pinned."""

    def __init__(self, model: str, workdir: Path, decode_delay: float):
        super().__init__(model, workdir, core=None)
        self.logdir = workdir / "logs" / "vllm-inproc"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.decode_delay = decode_delay

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "pdserve.bench.inproc", "--model", self.model,
                "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                "--disable-uvicorn-access-log", "--decode-delay", str(self.decode_delay)]


def part_c(args: argparse.Namespace, model: str, out: Path, res: dict[str, Any],
           saved: Callable[[], None]) -> None:
    from pdserve.bench import inproc

    levels = [int(c) for c in args.c_concurrency.split(",") if c.strip()]
    delay = args.c_decode_delay
    rows: list[dict[str, Any]] = res.setdefault("rows", [])
    res["workload"] = (f"{args.c_input_len} prompt tokens, {args.c_output_len} out, one token "
                       f"every {1e3 * delay:g} ms per request")
    with contextlib.ExitStack() as stack:
        # All up at once (idle, they cost little), so that each level's runs are back to back.
        servers: dict[str, tuple[str, str]] = {}  # name -> (url, the server's process group)
        dep: cluster.Deployment = stack.enter_context(InprocDeployment(model, out, delay))
        servers["vllm"] = (dep.start(args.start_timeout), "vllm-server")
        deps: dict[str, cluster.Deployment] = {"vllm": dep}
        for spec in [s.strip() for s in args.c_configs.split(",") if s.strip()]:
            cfg = fake_pool(spec)
            name = f"pdserve {cfg.name.removeprefix('fake-')}"
            dep = stack.enter_context(cluster.PdDeployment(
                cluster.Config(f"c-{cfg.name}", cfg.prefill, cfg.decode, cfg.both), model, out,
                keys=True, worker_cmd=fake_worker_cmd(model, delay)))
            servers[name] = (dep.start(args.start_timeout), "controller")
            deps[name] = dep
        warm = _trace(out, "c-warmup", 8, args.c_input_len, 16, args.seed, 97)
        for name, (url, _) in servers.items():
            run_client(ClientRun(url, model, warm, 8, out / "raw" / "c-warmup.json", metrics.Slo(),
                                 max_concurrency=8), deps[name].logdir / "client.log", args.seed)
        for i, c in enumerate(levels):
            n = 2 * c
            trace = _trace(out, f"c-c{c}", n, args.c_input_len, args.c_output_len, args.seed, i)
            for r in range(args.c_rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for name in order:
                    url, group = servers[name]
                    procs.wait_quiet(args.quiet_below, args.quiet_timeout)
                    tag = name.replace(" ", "-")
                    run = run_measured(ClientRun(url, model, trace, n,
                                                 out / "raw" / f"c-{tag}-c{c}-r{r}.json",
                                                 metrics.Slo(), max_concurrency=c),
                                       deps[name].groups(), deps[name].logdir / "client.log",
                                       args.seed)
                    rows.append(_cost_row(name, group, c, r, run))
                    logger.info("%s concurrency %d round %d: %.1f us per token", name, c, r,
                                rows[-1]["server_us_per_token"])
                for row in rows:
                    if row["concurrency"] == c and row["round"] == r:
                        base = next(x for x in rows if x["server"] == "vllm"
                                    and x["concurrency"] == c and x["round"] == r)
                        row["x_vllm"] = round(row["server_us_per_token"]
                                              / max(base["server_us_per_token"], 1e-9), 2)
                saved()
    # What the fake engine itself costs per token inside vLLM's server (its figure includes it).
    res["engine_us_per_token"] = {
        c: inproc.engine_cost(c, 2 * c, args.c_input_len, args.c_output_len, delay)
        for c in levels}
    saved()


def _cost_row(name: str, group: str, concurrency: int, rnd: int, run: dict[str, Any]
              ) -> dict[str, Any]:
    result = run.pop("result")
    recs = metrics.records_from_vllm(result)
    s = metrics.summarize(recs, run["duration"], metrics.Slo())
    ok = [r for r in recs if r.ok]
    tokens = sum(r.output_len for r in ok)
    chunks = sum(len(r.itl) + 1 for r in ok)
    server = run["cpu"][group]
    rest = sum(v["cpu_s"] for k, v in run["cpu"].items()
               if k not in (group, "machine", "others", "client"))
    return {"server": name, "concurrency": concurrency, "round": rnd, "tokens": tokens,
            "failed": s["failed"], "output_tok_s": s["output_throughput"],
            "server_core_pct": server["core_pct"],
            "server_us_per_token": round(1e6 * server["cpu_s"] / max(tokens, 1), 1),
            "tokens_per_chunk": round(tokens / max(chunks, 1), 2),
            "workers_core_pct": round(100.0 * rest / run["duration"], 1),
            "client_core_pct": run["cpu"]["client"]["core_pct"],
            "others_core_pct": run["cpu"]["others"]["core_pct"],
            "itl_p50_ms": s["itl"]["p50"], "itl_p99_ms": s["itl"]["p99"]}


def ratios_by_server(rows: list[dict[str, Any]]) -> list[tuple[str, int, list[float]]]:
    """Each of pdserve's servers' ratios to vLLM's server, round by round, per level: one
    round's ratio moves with the machine (others' jobs, the VM's neighbours), their median
    less."""
    by: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if r["server"] != "vllm" and "x_vllm" in r:
            by.setdefault((r["server"], r["concurrency"]), []).append(r["x_vllm"])
    return [(server, level, ratios) for (server, level), ratios in by.items()]


def markdown(res: dict[str, Any]) -> str:
    out = ["# pdserve bench overhead", "", f"- command: `{res['command']}`",
           f"- model: `{res['model']}`", ""]
    if "a" in res:
        a = res["a"]
        out += ["## (a) one engine: vLLM's server vs through pdserve", "",
                f"Workload: {a['workload']}.", "",
                ("| served by | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | "
                 "ITL p50 / p90 / p99 (ms) | E2E p50 / p90 / p99 (ms) | CPU ms per output token |"),
                "|---|---|---|---|---|---|"]
        for name in ("vllm", "pdserve"):
            s = a[name]["summary"]
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in a[name]["cpu_ms_per_token"].items())
            out.append(f"| {name} | " + " | ".join(report.fmt_trio(s[m]) for m in metrics.METRICS)
                       + f" | {cpu} |")
        out.append("")
    if "b" in res:
        out += ["## (b) controller with fake workers that produce tokens instantly", "",
                ("| pool | CurveZMQ | in flight | output tokens/s | controller CPU (% of a core) "
                 "| controller CPU per token (us) | fake workers CPU | benchmark client CPU "
                 "| others' CPU | TTFT p50 (ms) | ITL p99 (ms) | failed |"),
                "|" + "---|" * 12]
        for r in res["b"]:
            out.append(f"| {r['config']} | {'on' if r['keys'] else 'off'} | {r['concurrency']} "
                       f"| {r['output_tok_s']:,.0f} | {r['controller_core_pct']:.0f} "
                       f"| {r['controller_us_per_token']:.0f} | {r['workers_core_pct']:.0f} "
                       f"| {r['client_core_pct']:.0f} | {r['others_core_pct']:.0f} "
                       f"| {report.fmt_ms(r['ttft_p50_ms'])} | {report.fmt_ms(r['itl_p99_ms'])} "
                       f"| {r['failed']} |")
        out.append("")
    if "c" in res:
        c = res["c"]
        out += ["## (c) server CPU per streamed token: vLLM's server vs pdserve's controller", "",
                f"Workload: {c.get('workload', '')}; the same fake engine behind each (in-process "
                "behind vLLM's server, in fake worker processes behind pdserve, CurveZMQ on).", "",
                ("| server | in flight | round | output tokens/s | server CPU (% of a core) "
                 "| server CPU per token (us) | x vLLM's | tokens per SSE chunk "
                 "| fake workers CPU | benchmark client CPU | others' CPU | ITL p50 / p99 (ms) "
                 "| failed |"),
                "|" + "---|" * 13]
        for r in c.get("rows", []):
            out.append(f"| {r['server']} | {r['concurrency']} | {r['round']} "
                       f"| {r['output_tok_s']:,.0f} | {r['server_core_pct']:.0f} "
                       f"| {r['server_us_per_token']:.0f} | {r.get('x_vllm', float('nan')):.2f} "
                       f"| {r['tokens_per_chunk']:.2f} | {r['workers_core_pct']:.0f} "
                       f"| {r['client_core_pct']:.0f} | {r['others_core_pct']:.0f} "
                       f"| {report.fmt_ms(r['itl_p50_ms'])} / {report.fmt_ms(r['itl_p99_ms'])} "
                       f"| {r['failed']} |")
        for server, level, ratios in ratios_by_server(c.get("rows", [])):
            out.append(f"\n{server}, {level} in flight: {statistics.median(ratios):.2f}x vLLM's "
                       f"server's CPU per token, the median of {len(ratios)} rounds "
                       f"({min(ratios):.2f}-{max(ratios):.2f}).")
        for lvl, us in c.get("engine_us_per_token", {}).items():
            out.append(f"\nThe fake engine alone (in-process, {lvl} in flight, same pacing): "
                       f"{us:.0f} us of CPU per token, included in vLLM's server's figure.")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    procs.stop_on_sigterm()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"bench-results/overhead-{stamp}")
    (out / "raw").mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model, args.preset)
    res: dict[str, Any] = {"command": "pdserve bench overhead " + shlex.join(argv),
                           "model": model, "date": stamp}

    def save() -> None:
        (out / "overhead.json").write_text(json.dumps(report.no_nan(res), indent=2) + "\n")
        (out / "overhead.md").write_text(markdown(res))

    if args.part in ("a", "all"):
        res["a"] = part_a(args, model, out)
        save()
    if args.part in ("b", "all"):
        res["b"] = []
        part_b(args, model, out, res["b"], save)
    if args.part in ("c", "all"):
        res["c"] = {}
        part_c(args, model, out, res["c"], save)
    print(markdown(res))
    print(f"results in {out}/ (overhead.json, overhead.md)")
    return 0
