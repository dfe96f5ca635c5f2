"""`pdserve bench handoff`: P/D's one pause, counted in decode steps of the same engine.

For each prompt length, sequential streaming requests (one in flight, greedy, a fixed output
length) go first to vLLM's own OpenAI server serving one engine on the decode worker's core (its
ITL is that engine's decode step as a client sees it), then to pdserve 1P1D on the same cores
(prefill worker on one, decode worker on the other, every prompt disaggregated). For pdserve the
first gap of each stream (first token, from the prefill, to the second, the decode worker's
first) is the handoff; the gaps after it are its decode path. The controller's handoff phases
are scraped around each length. With --rounds N the two alternate N times, each round with a
table of its own: this machine's speed drifts by tens of percent within minutes, so a ratio
means something only between runs close in time.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from pdserve.bench import cluster, metrics, procs, scrape, workload
from pdserve.bench.client import ClientRun, run_client
from pdserve.controller.phases import PHASES
from pdserve.models import resolve_model

logger = logging.getLogger(__name__)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench handoff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the preset's)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--lengths", default="100,300,1000,2000", help="prompt tokens, comma-separated")
    p.add_argument("--prompts", type=int, default=15, help="requests per length")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--cores", default="0,1", help="prefill core, decode core (vLLM's server "
                   "gets the decode core)")
    p.add_argument("--worker-args", default="", help="extra `pdserve worker` arguments")
    p.add_argument("--skip-vllm", action="store_true", help="measure pdserve only")
    p.add_argument("--rounds", type=int, default=2,
                   help="vLLM's server then pdserve, this many times (a table each)")
    p.add_argument("--out", default=None, help="default: bench-results/handoff-<timestamp>")
    p.add_argument("--seed", type=int, default=0)
    procs.add_start_and_quiet_args(p)
    return p


def p50(xs: list[float]) -> float | None:
    return metrics.percentiles(xs, (50,))["p50"] if xs else None


def p99(xs: list[float]) -> float | None:
    return metrics.percentiles(xs, (99,))["p99"] if xs else None


def figures(recs: list[metrics.Record]) -> dict[str, Any]:
    """Per-length figures in ms: the first gap apart from the gaps after it."""
    ok = [r for r in recs if r.ok and r.itl]
    first = [r.itl[0] for r in ok]
    later = [g for r in ok for g in r.itl[1:]]
    return {"requests": len(recs), "ok": len(ok),
            "ttft_p50_ms": p50([r.ttft for r in ok]),
            "first_gap_p50_ms": p50(first), "first_gap_p99_ms": p99(first),
            "itl_after_p50_ms": p50(later), "itl_all_p50_ms": p50([g for r in ok for g in r.itl]),
            "e2e_p50_ms": p50([r.e2e for r in ok])}


def measure(dep: cluster.Deployment, name: str, lengths: list[int], args: argparse.Namespace,
            model: str, out: Path) -> dict[int, dict[str, Any]]:
    url = dep.start(args.start_timeout)
    log = dep.logdir / "client.log"
    res: dict[int, dict[str, Any]] = {}
    for i, n_tokens in enumerate(lengths):
        def trace(tag: str, n: int, run: int) -> Path:
            items = workload.make_workload(workload.uniform(n_tokens, args.output_len), n,
                                           float("inf"), 1.0, args.seed + run)
            return workload.write_trace(items, out / "raw" / f"{name}-{tag}.jsonl", run=run)

        run_client(ClientRun(url, model, trace(f"warm{n_tokens}", 3, 90 + i), 3,
                             out / "raw" / f"{name}-warm{n_tokens}.json", metrics.Slo(),
                             max_concurrency=1), log, args.seed)
        procs.wait_quiet(args.quiet_below, args.quiet_timeout)
        before = scrape.scrape(url) if name == "pdserve" else {}
        result = run_client(ClientRun(url, model, trace(f"p{n_tokens}", args.prompts, i),
                                      args.prompts, out / "raw" / f"{name}-p{n_tokens}.json",
                                      metrics.Slo(), max_concurrency=1), log, args.seed)
        row = figures(metrics.records_from_vllm(result))
        if name == "pdserve":
            d = scrape.delta(before, scrape.scrape(url))
            row["phases_ms"] = {p: d.get(f"handoff_{p}_mean_ms") for p in PHASES}
        res[n_tokens] = row
        logger.info("%s, %d prompt tokens: %s", name, n_tokens,
                    {k: v for k, v in row.items() if k != "phases_ms"})
    return res


def measure_round(args: argparse.Namespace, model: str, lengths: list[int], cores: list[int],
                  out: Path) -> dict[str, Any]:
    """vLLM's server on the decode core, then pdserve 1P1D on both."""
    (out / "raw").mkdir(parents=True, exist_ok=True)
    run: dict[str, Any] = {}
    if not args.skip_vllm:
        with cluster.VllmDeployment(model, out, core=str(cores[1]),
                                    extra=cluster.engine_mode(args.worker_args.split())) as dep:
            run["vllm"] = measure(dep, "vllm", lengths, args, model, out)
    cfg = cluster.Config("handoff-1P1D", prefill=1, decode=1, local_threshold=0)
    with cluster.PdDeployment(cfg, model, out, worker_args=args.worker_args.split(),
                              cores=cores) as pd:
        run["pdserve"] = measure(pd, "pdserve", lengths, args, model, out)
    return run


def markdown(res: dict[str, Any]) -> str:
    lines = ["# pdserve bench handoff", "", f"- command: `{res['command']}`",
             f"- model: `{res['model']}`", f"- {res['workload']}", ""]
    for i, run in enumerate(res["rounds"]):
        if len(res["rounds"]) > 1:
            lines += [f"## Round {i + 1}", ""]
        lines += _round(run)
    return "\n".join(lines) + "\n"


def _round(run: dict[str, Any]) -> list[str]:
    """One round's tables: pdserve against the vLLM run just before it."""
    lines = ["| prompt tokens | vLLM's server: ITL p50 (ms) | pdserve: TTFT p50 | first -> second "
             "token p50 / p99 | in decode steps (p50) | ITL after it p50 | x vLLM's ITL "
             "| E2E p50 (pdserve / vLLM) |", "|" + "---|" * 8]

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    for n, pd in run["pdserve"].items():
        v = run.get("vllm", {}).get(n, {})
        step = v.get("itl_all_p50_ms")
        gap, after = pd["first_gap_p50_ms"], pd["itl_after_p50_ms"]
        steps = f"{gap / step:.2f}" if gap and step else "-"
        ratio = f"{after / step:.2f}" if after and step else "-"
        lines.append(f"| {n} | {f(step)} | {f(pd['ttft_p50_ms'])} | {f(gap)} / "
                     f"{f(pd['first_gap_p99_ms'])} | {steps} | {f(after)} | {ratio} | "
                     f"{f(pd['e2e_p50_ms'])} / {f(v.get('e2e_p50_ms'))} |")
    lines += ["", "The handoff by phase (the controller's means, ms):", "",
              "| prompt tokens | " + " | ".join(PHASES) + " | sum |", "|" + "---|" * (len(PHASES) + 2)]
    for n, pd in run["pdserve"].items():
        ph = pd.get("phases_ms") or {}
        vals = [ph.get(p) for p in PHASES]
        total = sum(x for x in vals if x is not None)
        lines.append(f"| {n} | " + " | ".join(f(x) for x in vals) + f" | {total:.1f} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    model = resolve_model(args.model, args.preset)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    cores = [int(c) for c in args.cores.split(",")]
    if args.rounds < 1 or len(cores) != 2:
        raise SystemExit("pdserve bench handoff: --rounds must be at least 1 and --cores two cores")
    out = Path(args.out or f"bench-results/handoff-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"command": "pdserve bench handoff " + " ".join(argv), "model": model,
                           "workload": f"{args.prompts} sequential requests per length, "
                           f"{args.output_len} output tokens, greedy"}
    res["rounds"] = [measure_round(args, model, lengths, cores,
                                   out / f"round{r + 1}" if args.rounds > 1 else out)
                     for r in range(args.rounds)]
    (out / "handoff.json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    (out / "handoff.md").write_text(text)
    print(text)
    print(f"results in {out}/ (handoff.json, handoff.md)")
    return 0
