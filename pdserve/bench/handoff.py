"""`pdserve bench handoff`: P/D's one pause, counted in decode steps of the same engine.

For each prompt length, sequential streaming requests (one in flight, greedy, a fixed output
length) go to vLLM's own OpenAI server serving one engine on the decode worker's core (its ITL
is that engine's decode step as a client sees it) and to pdserve 1P1D on the same cores
(prefill worker on one, decode worker on the other, every prompt disaggregated). For pdserve the
first gap of each stream (first token, from the prefill, to the second, the decode worker's
first) is the handoff; the gaps after it are its decode path. The controller's handoff phases
are scraped around each length. The client runs on the prefill core, as one on another host
would leave the decode core to the engine (`--client-free`: on any core).

`--router` adds the peer path on the same cores: P then D through vllm-router in front of two
vLLM servers with pdserve's CPU connector (the router asks the prefill server for one token,
then streams the decode server's answer, whose engine reads the KV). Its first token comes after
the handoff; pdserve streams the prefill's token at once.

This machine's speed drifts by tens of percent within minutes, so the two run side by side and
take turns (`--interleave N`: N requests to one, N to the other, in the order ABBA...): both
see the same minutes, and each turn's ratio is taken against the other's turn beside it. With
`--interleave 0` they run one after the other instead. `--rounds N` starts and measures them N
times, each round with a table of its own and in the other order from the last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
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
    p.add_argument("--client-free", action="store_true",
                   help="let the client run on any core (default: the prefill core, as a client "
                   "on another host would leave the decode core to the engine)")
    p.add_argument("--worker-args", default="", help="extra `pdserve worker` arguments")
    p.add_argument("--skip-vllm", action="store_true",
                   help="no vLLM server on one engine (pdserve, and the router with --router)")
    p.add_argument("--router", action="store_true",
                   help="also P then D through vllm-router on two vLLM servers with pdserve's "
                   "connector, on the same cores")
    p.add_argument("--interleave", type=int, default=5,
                   help="requests per turn, the systems side by side taking turns (0: one "
                   "after the other)")
    p.add_argument("--rounds", type=int, default=1,
                   help="start the systems and measure, this many times (a table each, every "
                   "other round starting them in the reverse order)")
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


def measure(deps: dict[str, cluster.Deployment], lengths: list[int], args: argparse.Namespace,
            model: str, out: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """Each length's figures per system. The systems take turns of `--interleave` requests
    (all of them in one turn if 0), in the order ABBA..., the same prompts for each."""
    urls = {name: dep.base_url for name, dep in deps.items()}
    routers = {name: dep.decode_url for name, dep in deps.items()  # their decode servers
               if isinstance(dep, cluster.RouterDeployment)}
    log = out / "client.log"
    turn = args.interleave or args.prompts
    cores = None if args.client_free else frozenset({int(args.cores.split(",")[0])})
    res: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in deps}

    def client(name: str, tag: str, items: list[workload.Item], run: int) -> list[Any]:
        trace = workload.write_trace(items, out / "raw" / f"{name}-{tag}.jsonl", run=run)
        result = run_client(ClientRun(urls[name], model, trace, len(items),
                                      out / "raw" / f"{name}-{tag}.json", metrics.Slo(),
                                      max_concurrency=1, cores=cores), log, args.seed)
        return metrics.records_from_vllm(result)

    for i, n_tokens in enumerate(lengths):
        warm = workload.make_workload(workload.uniform(n_tokens, args.output_len), 3,
                                      float("inf"), 1.0, args.seed + 90 + i)
        for name in deps:
            client(name, f"warm{n_tokens}", warm, 90 + i)
        items = workload.make_workload(workload.uniform(n_tokens, args.output_len), args.prompts,
                                       float("inf"), 1.0, args.seed + i)
        procs.wait_quiet(args.quiet_below, args.quiet_timeout)
        before = scrape.scrape(urls["pdserve"]) if "pdserve" in urls else {}
        reads = {name: scrape.nixl_reads(url) for name, url in routers.items()}
        recs: dict[str, list[list[metrics.Record]]] = {name: [] for name in deps}
        for t, start in enumerate(range(0, len(items), turn)):
            for name in (list(deps) if t % 2 == 0 else list(deps)[::-1]):
                recs[name].append(client(name, f"p{n_tokens}-{t}", items[start:start + turn], i))
        for name, turns in recs.items():
            res[name][n_tokens] = figures([r for rs in turns for r in rs])
        if "pdserve" in urls:
            d = scrape.delta(before, scrape.scrape(urls["pdserve"]))
            res["pdserve"][n_tokens]["phases_ms"] = {p: d.get(f"handoff_{p}_mean_ms")
                                                     for p in PHASES}
        for name, url in routers.items():  # every prompt handed over, as pdserve's are
            (n0, b0), (n1, b1) = reads[name], scrape.nixl_reads(url)
            res[name][n_tokens] |= {"kv_reads": n1 - n0, "kv_read_mb": round((b1 - b0) / 1e6, 2)}
        if "vllm" in recs and "pdserve" in recs:
            res["pdserve"][n_tokens]["itl_x_vllm_per_turn"] = turn_ratios(recs["pdserve"],
                                                                          recs["vllm"])
        for name in deps:
            logger.info("%s, %d prompt tokens: %s", name, n_tokens,
                        {k: v for k, v in res[name][n_tokens].items() if k != "phases_ms"})
    return res


def turn_ratios(pd: list[list[metrics.Record]], vllm: list[list[metrics.Record]]
                ) -> list[float]:
    """Per turn: pdserve's ITL p50 after the handoff over vLLM's ITL p50 in the turn beside it."""
    out = []
    for a, b in zip(pd, vllm):
        after, step = figures(a)["itl_after_p50_ms"], figures(b)["itl_all_p50_ms"]
        if after and step:
            out.append(round(after / step, 3))
    return out


def deployment(name: str, args: argparse.Namespace, model: str, cores: list[int],
               out: Path) -> cluster.Deployment:
    """vLLM's server on the decode core, or pdserve 1P1D on both (every prompt handed over)."""
    if name == "vllm":
        return cluster.VllmDeployment(model, out, core=str(cores[1]),
                                      extra=cluster.engine_mode(args.worker_args.split()))
    if name == "router":
        return cluster.RouterDeployment(model, out, cores,
                                        extra=cluster.engine_mode(args.worker_args.split()))
    cfg = cluster.Config("handoff-1P1D", prefill=1, decode=1, local_threshold=0)
    return cluster.PdDeployment(cfg, model, out, worker_args=args.worker_args.split(),
                                cores=cores)


def start_order(args: argparse.Namespace, round_index: int) -> list[str]:
    """The systems in the order they start and take their first turn. Two identical pdserve
    deployments side by side differed by 8% in their decode engine's CPU per token at 2,000
    tokens, for no reason their code holds, so every other round reverses the order: whatever
    a system's start gives it does not always fall to the same one."""
    names = ([] if args.skip_vllm else ["vllm"]) + ["pdserve"] + (["router"] if args.router
                                                                 else [])
    return names[::-1] if round_index % 2 else names


def measure_round(args: argparse.Namespace, model: str, lengths: list[int], cores: list[int],
                  out: Path, round_index: int = 0) -> dict[str, Any]:
    """vLLM's server and pdserve side by side, or one after the other (`--interleave 0`)."""
    (out / "raw").mkdir(parents=True, exist_ok=True)
    names = start_order(args, round_index)
    if not args.interleave:
        run: dict[str, Any] = {}
        for name in names:
            with deployment(name, args, model, cores, out) as dep:
                dep.start(args.start_timeout)
                run |= measure({name: dep}, lengths, args, model, out)
        return run
    with contextlib.ExitStack() as stack:
        deps: dict[str, cluster.Deployment] = {}
        for name in names:  # one at a time: engines starting together on one core may hang
            deps[name] = stack.enter_context(deployment(name, args, model, cores, out))
            deps[name].start(args.start_timeout)
        return measure(deps, lengths, args, model, out)


def per_turn(pd: dict[str, Any]) -> str:
    """The turns' ratios: their median and range, e.g. `1.02 (0.97-1.08)`."""
    xs = sorted(pd.get("itl_x_vllm_per_turn") or [])
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} ({xs[0]:.2f}-{xs[-1]:.2f})"


def markdown(res: dict[str, Any]) -> str:
    lines = ["# pdserve bench handoff", "", f"- command: `{res['command']}`",
             f"- model: `{res['model']}`", f"- {res['workload']}", ""]
    for i, run in enumerate(res["rounds"]):
        if len(res["rounds"]) > 1:
            lines += [f"## Round {i + 1}", ""]
        lines += _round(run)
    return "\n".join(lines) + "\n"


def _round(run: dict[str, Any]) -> list[str]:
    """One round's tables: pdserve against the vLLM run beside it."""
    lines = ["| prompt tokens | vLLM's server: ITL p50 (ms) | pdserve: TTFT p50 | first -> second "
             "token p50 / p99 | in decode steps (p50) | ITL after it p50 | x vLLM's ITL "
             "| E2E p50 (pdserve / vLLM) | x vLLM's ITL per turn |", "|" + "---|" * 9]

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
                     f"{f(pd['e2e_p50_ms'])} / {f(v.get('e2e_p50_ms'))} | {per_turn(pd)} |")
    lines += ["", "The handoff by phase (the controller's means, ms):", "",
              "| prompt tokens | " + " | ".join(PHASES) + " | sum |", "|" + "---|" * (len(PHASES) + 2)]
    for n, pd in run["pdserve"].items():
        ph = pd.get("phases_ms") or {}
        vals = [ph.get(p) for p in PHASES]
        total = sum(x for x in vals if x is not None)
        lines.append(f"| {n} | " + " | ".join(f(x) for x in vals) + f" | {total:.1f} |")
    return lines + [""] + (_against_router(run) if "router" in run else [])


def _against_router(run: dict[str, Any]) -> list[str]:
    """pdserve beside P then D through vllm-router: the router's first token comes after the
    handoff, pdserve's from the prefill."""
    lines = ["Against P then D through vllm-router (pdserve / router, p50, ms):", "",
             "| prompt tokens | TTFT | first -> second token | ITL after it | E2E | E2E x "
             "router's | router's KV reads (MB) |", "|" + "---|" * 7]

    def both(key: str, pd: dict[str, Any], r: dict[str, Any]) -> str:
        a, b = pd.get(key), r.get(key)
        return " / ".join("-" if v is None else f"{v:.1f}" for v in (a, b))

    for n, pd in run["pdserve"].items():
        r = run["router"].get(n, {})
        ratio = (f"{pd['e2e_p50_ms'] / r['e2e_p50_ms']:.2f}"
                 if pd.get("e2e_p50_ms") and r.get("e2e_p50_ms") else "-")
        reads = f"{r.get('kv_reads', 0):.0f} of {r.get('requests', 0)} ({r.get('kv_read_mb', 0)})"
        lines.append(f"| {n} | {both('ttft_p50_ms', pd, r)} | {both('first_gap_p50_ms', pd, r)} "
                     f"| {both('itl_after_p50_ms', pd, r)} | {both('e2e_p50_ms', pd, r)} | "
                     f"{ratio} | {reads} |")
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
                                   out / f"round{r + 1}" if args.rounds > 1 else out, r)
                     for r in range(args.rounds)]
    (out / "handoff.json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    (out / "handoff.md").write_text(text)
    print(text)
    print(f"results in {out}/ (handoff.json, handoff.md)")
    return 0
