"""Writes a benchmark's results: results.json, report.md and PNG plots.

`results` is the JSON-able dict main.py builds: {"meta": {...}, "configs": {name: {"idle_cpu":
{...}, "runs": [{"rate": r, "summary": {...}, "by_class": {...}, ...}]}}}. Plots also need the
per-request records, keyed by (configuration, rate). A schedule run also has "schedule" (its
label, shown where a rate would be), "segments" (per-segment summaries) and, in an auto
configuration, "duties" (duties.summary()).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.bench import duties
from pdserve.bench.metrics import METRICS, Record, samples
from pdserve.controller.phases import PHASES

NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}
Records = Mapping[tuple[str, float], Sequence[Record]]


def fmt_ms(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def fmt_ratio(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.2f}"


def fmt_trio(d: Mapping[str, float]) -> str:
    return " / ".join(fmt_ms(d[k]) for k in ("p50", "p90", "p99"))


def rate_label(run: Mapping[str, Any]) -> str:
    """A run's rate, or its schedule (RATE:SECONDS,...)."""
    return str(run.get("schedule") or f"{run['rate']:g}")


def latency_table(results: Mapping[str, Any]) -> list[str]:
    head = ("| configuration | rate (req/s) | done / failed | TTFT p50 / p90 / p99 (ms) "
            "| TPOT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | E2E p50 / p90 / p99 (ms) "
            "| throughput (req/s, out tok/s) | goodput (req/s) | SLO met | others' CPU |")
    lines = [head, "|" + "---|" * 11]
    for name, cfg in results["configs"].items():
        for run in cfg["runs"]:
            s = run["summary"]
            lines.append(
                f"| {name} | {rate_label(run)} | {s['completed']} / {s['failed']} "
                + "".join(f"| {fmt_trio(s[m])} " for m in METRICS)
                + f"| {s['request_throughput']:.2f}, {s['output_throughput']:.0f} "
                f"| {s['goodput']:.2f} | {s['slo_attainment']:.0%} | {_others(run)} |")
    return lines


def pause_table(results: Mapping[str, Any]) -> list[str]:
    lines = [("| configuration | rate | ITL p99.9 (ms) | longest gap (ms) | gaps >= 100 ms "
              "| requests with a gap >= 100 ms | worst gap per request, p90 (ms) "
              "| after the first gap: ITL p99.9 / longest (ms) "
              "| first gap p50 / p99 (ms) | in later ITL p50s |"), "|" + "---|" * 10]
    for name, cfg in results["configs"].items():
        for run in cfg["runs"]:
            p = run["summary"].get("pauses")
            if not p:
                continue
            lines.append(
                f"| {name} | {rate_label(run)} | {fmt_ms(p['itl_p99.9_ms'])} "
                f"| {fmt_ms(p['itl_max_ms'])} | {p['gaps_paused']:.2%} "
                f"| {p['requests_paused']:.0%} | {fmt_ms(p['worst_gap_p90_ms'])} "
                f"| {fmt_ms(p['later_itl_p99.9_ms'])} / {fmt_ms(p['later_itl_max_ms'])} "
                f"| {fmt_ms(p.get('first_gap_p50_ms'))} / {fmt_ms(p.get('first_gap_p99_ms'))} "
                f"| {fmt_ratio(p.get('first_gap_p50_steps'))} "
                f"/ {fmt_ratio(p.get('first_gap_p99_steps'))} |")
    return lines


def cache_table(results: Mapping[str, Any]) -> list[str]:
    """Prompt tokens served from the prefix cache and computed, next to what that buys; the
    controller's own cache figures once it exports them (scrape.cache_figures)."""
    lines = [("| configuration | rate | requests | prompt tokens | cached | computed | hit rate "
              "| TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | goodput (req/s) | KV moved (MB) "
              "| prefill / decode hit rate |"), "|" + "---|" * 12]
    for name, cfg in results["configs"].items():
        for run in cfg["runs"]:
            if not _has_cache_figures(run):
                continue
            # The client's figures (usage.prompt_tokens_details), when the server reported them.
            s, c = run["summary"], run["summary"].get("cache") or {}
            k = run.get("controller_cache") or {}
            moved = k.get("kv_bytes_moved")
            # The controller's figure counts every engine's computing (a decode engine's
            # remainder too), which usage's one count per answer cannot.
            computed = k.get("prompt_tokens_computed")
            if computed is None:
                computed = c["computed_tokens"]
            lines.append(
                f"| {name} | {rate_label(run)} | {c.get('requests', '-')} "
                f"| {_count(c.get('prompt_tokens'))} | {_count(c.get('cached_tokens'))} "
                f"| {int(computed):,} | {_share(c.get('hit_rate'))} "
                f"| {fmt_ms(s['ttft']['p50'])} / {fmt_ms(s['ttft']['p99'])} "
                f"| {fmt_ms(s['tpot']['p50'])} / {fmt_ms(s['tpot']['p99'])} | {s['goodput']:.2f} "
                f"| {'-' if moved is None else f'{moved / 1e6:,.1f}'} "
                f"| {_share(k.get('prefill_cache_hit_rate'))} / "
                f"{_share(k.get('decode_cache_hit_rate'))} |")
    return lines


def _has_cache_figures(run: Mapping[str, Any]) -> bool:
    """The client's prefix-cache figures, or the controller's computed-token count."""
    return bool(run["summary"].get("cache")) or (
        (run.get("controller_cache") or {}).get("prompt_tokens_computed") is not None)


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _count(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def _others(run: Mapping[str, Any]) -> str:
    """CPU other people's processes used during the run (% of one core): noise to watch."""
    others = run.get("cpu", {}).get("others")
    return "-" if others is None else f"{others['core_pct']:.0f}%"


def class_table(results: Mapping[str, Any]) -> list[str]:
    lines = [("| configuration | rate | class | requests | TTFT p50 / p99 (ms) | "
              "TPOT p50 / p99 (ms) | ITL p99 (ms) | SLO met |"), "|" + "---|" * 8]
    for name, cfg in results["configs"].items():
        for run in cfg["runs"]:
            for cls, s in run.get("by_class", {}).items():
                lines.append(
                    f"| {name} | {rate_label(run)} | {cls} | {s['requests']} "
                    f"| {fmt_ms(s['ttft']['p50'])} / {fmt_ms(s['ttft']['p99'])} "
                    f"| {fmt_ms(s['tpot']['p50'])} / {fmt_ms(s['tpot']['p99'])} "
                    f"| {fmt_ms(s['itl']['p99'])} | {s['slo_attainment']:.0%} |")
    return lines


def idle_table(results: Mapping[str, Any]) -> list[str]:
    """CPU of each process group idle and under load; `machine` is all cores, `others` is what
    other people's processes used during a run (noise), `client` is vLLM's benchmark client."""
    lines = [("| configuration | process group | core | idle CPU after warm-up (% of a core) "
              "| idle CPU after the runs | CPU under load, rate: % of a core |"),
             "|---|---|---|---|---|---|"]
    for name, cfg in results["configs"].items():
        idle, after = cfg.get("idle_cpu", {}), cfg.get("idle_cpu_after", {})
        procs = list(dict.fromkeys([*idle, *(p for r in cfg["runs"] for p in r.get("cpu", {}))]))
        for proc in procs:
            core = cfg.get("cores", {}).get(proc) or "-"
            cells = [f"{d[proc]['core_pct']:.1f}" if proc in d else "-" for d in (idle, after)]
            load = ", ".join(f"{rate_label(r)}: {r['cpu'][proc]['core_pct']:.0f}"
                             for r in cfg["runs"] if proc in r.get("cpu", {}))
            lines.append(f"| {name} | {proc} | {core} | {cells[0]} | {cells[1]} | {load} |")
    return lines


def phase_table(results: Mapping[str, Any]) -> list[str]:
    """The controller's own means: queueing, prefill leg, KV handoff, TTFT."""
    lines = [("| configuration | rate | queue (ms) | prefill leg (ms) | KV handoff + first "
              "decode step (ms) | TTFT at the controller (ms) | local prefills |"),
             "|" + "---|" * 7]
    for name, cfg in results["configs"].items():
        for run in cfg["runs"]:
            c = run.get("controller") or {}
            cells = [fmt_ms(c.get(f"{k}_mean_ms")) for k in
                     ("queue_time", "prefill_time", "kv_handoff", "time_to_first_token")]
            local = int(c.get("pdserve_local_prefills_total", 0))
            lines.append(f"| {name} | {rate_label(run)} | " + " | ".join(cells) + f" | {local} |")
    return lines


def handoff_table(results: Mapping[str, Any]) -> list[str]:
    """The handoff's phases (pdserve_handoff_phase_seconds), where a run has them, and how
    many of its KV reads were inside the step computing the next token (pdserve_kv_reads_total)."""
    lines = ["| configuration | rate | " + " | ".join(f"{p} (ms)" for p in PHASES)
             + " | reads in step / in steps of their own |",
             "|" + "---|" * (3 + len(PHASES))]
    rows = 0
    for name, cfg in results["configs"].items():
        for run in cfg["runs"]:
            c = run.get("controller") or {}
            if not any(f"handoff_{p}_mean_ms" in c for p in PHASES):
                continue
            rows += 1
            reads = " / ".join(str(int(c.get(f"pdserve_kv_reads_total{{mode={mode}}}", 0)))
                               for mode in ("in_step", "own_step"))
            lines.append(f"| {name} | {rate_label(run)} | " + " | ".join(
                fmt_ms(c.get(f"handoff_{p}_mean_ms")) for p in PHASES) + f" | {reads} |")
    return lines if rows else []


def segment_table(results: Mapping[str, Any]) -> list[str]:
    """Schedule runs segment by segment, then whole, configuration by configuration: the same
    trace, so the rows of one segment compare the configurations."""
    lines = [("| configuration | segment (s) | rate (req/s) | requests | TTFT p50 / p99 (ms) "
              "| TPOT p50 / p99 (ms) | goodput (req/s) | SLO met |"), "|" + "---|" * 8]
    for name, cfg in results["configs"].items():
        for run in cfg["runs"]:
            for seg in run.get("segments") or []:
                span = f"{seg['start_s']:g}-{seg['start_s'] + seg['seconds']:g}"
                lines.append(_segment_row(name, span, f"{seg['rate']:g}", seg["summary"]))
            if run.get("segments"):
                lines.append(_segment_row(name, "whole run", f"{run['rate']:.2f} (mean)",
                                          run["summary"]))
    return lines


def _segment_row(name: str, span: str, rate: str, s: Mapping[str, Any]) -> str:
    return (f"| {name} | {span} | {rate} | {s['requests']} "
            f"| {fmt_ms(s['ttft']['p50'])} / {fmt_ms(s['ttft']['p99'])} "
            f"| {fmt_ms(s['tpot']['p50'])} / {fmt_ms(s['tpot']['p99'])} "
            f"| {s['goodput']:.2f} | {s['slo_attainment']:.0%} |")


def best_run(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The run with the highest goodput (ties: the higher rate)."""
    runs = cfg.get("runs") or []
    return max(runs, key=lambda r: (r["summary"]["goodput"], r["rate"]), default=None)


def comparison(results: Mapping[str, Any], baseline: str = "colocated") -> list[str]:
    """Each XpYd against the baseline at its best rate, and rate by rate."""
    cfgs = results["configs"]
    if baseline not in cfgs:
        return []
    base = best_run(cfgs[baseline])
    lines = [("| configuration | best rate | goodput (req/s) | x baseline's best | ITL p99 (ms) "
              "| / baseline's at its best |"), "|---|---|---|---|---|---|"]
    for name, cfg in cfgs.items():
        best = best_run(cfg)
        if best is None or base is None:
            continue
        g, bg = best["summary"]["goodput"], base["summary"]["goodput"]
        i, bi = best["summary"]["itl"]["p99"], base["summary"]["itl"]["p99"]
        lines.append(f"| {name} | {rate_label(best)} | {g:.2f} | {_ratio(g, bg)} | {fmt_ms(i)} "
                     f"| {_ratio(i, bi)} |")
    return lines


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}x"


def markdown(results: Mapping[str, Any]) -> str:
    meta = results.get("meta", {})
    out = ["# pdserve bench", ""]
    for key in ("command", "model", "workload", "slo", "schedule", "burstiness", "date",
                "machine"):
        if key in meta:
            out.append(f"- {key}: `{meta[key]}`")
    out += ["", "## Latency, throughput and goodput", "", *latency_table(results)]
    if any(run.get("segments") for c in results["configs"].values() for run in c["runs"]):
        out += ["", f"## By segment of the schedule {meta.get('schedule', '')}".rstrip()
                + " (requests by when they were sent; goodput over each segment's seconds)",
                "", *segment_table(results)]
    duty = [line for name, c in results["configs"].items() for run in c["runs"]
            if run.get("duties") for line in duties.markdown(f"{name} at {rate_label(run)}", run)]
    if duty:
        out += ["", "## Duties of the auto workers (polled about once a second)", *duty]
    if any(_has_cache_figures(run) for c in results["configs"].values() for run in c["runs"]):
        out += ["", "## Prefix cache (computed = prompt tokens - cached tokens)", "",
                *cache_table(results)]
    if any(run["summary"].get("pauses") for c in results["configs"].values()
           for run in c["runs"]):
        out += ["", "## Pauses in the streams (the tail ITL p99 hides)", "",
                *pause_table(results)]
    if any(run.get("by_class") for c in results["configs"].values() for run in c["runs"]):
        out += ["", "## By request class", "", *class_table(results)]
    if comp := comparison(results):
        out += ["", "## Against the colocated baseline (best goodput of each)", "", *comp]
    if any(run.get("controller") for c in results["configs"].values() for run in c["runs"]):
        out += ["", "## Phases as the controller measures them (means)", "",
                *phase_table(results)]
        if handoff := handoff_table(results):
            out += ["", "## The KV handoff by phase (means; controller/phases.py)", "",
                    *handoff]
    out += ["", "## CPU per process group (whole group: worker and its engine processes)", "",
            *idle_table(results), ""]
    return "\n".join(out)


def plot_cdfs(records: Records, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r for _, r in records})
    configs = list(dict.fromkeys(c for c, _ in records))
    fig, axes = plt.subplots(len(rates), len(METRICS), squeeze=False,
                             figsize=(4 * len(METRICS), 3 * len(rates)))
    for row, rate in enumerate(rates):
        for col, metric in enumerate(METRICS):
            ax = axes[row][col]
            for cfg in configs:
                xs = sorted(v * 1e3 for v in samples(records.get((cfg, rate), []), metric))
                if xs:
                    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=cfg)
            if metric in ("ttft", "itl", "e2e"):
                ax.set_xscale("symlog", linthresh=1.0)
            ax.set_title(f"{NAMES[metric]} at {rate:g} req/s", fontsize=9)
            ax.set_xlabel("ms", fontsize=8)
            ax.grid(alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_goodput(results: Mapping[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, cfg in results["configs"].items():
        runs = sorted(cfg["runs"], key=lambda r: r["rate"])
        rates = [r["rate"] for r in runs]
        line = ax.plot(rates, [r["summary"]["goodput"] for r in runs], marker="o",
                       label=f"{name} goodput")[0]
        ax.plot(rates, [r["summary"]["request_throughput"] for r in runs], ls="--",
                color=line.get_color(), alpha=0.6, label=f"{name} throughput")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("req/s")
    ax.set_title(f"goodput under {results.get('meta', {}).get('slo', 'the SLO')}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(results: Mapping[str, Any], records: Records, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(no_nan(results), indent=2, default=_jsonable) + "\n")
    paths[1].write_text(markdown(results))
    if records:
        paths.append(plot_cdfs(records, out / "latency_cdf.png"))
    if any(c["runs"] for c in results["configs"].values()):
        paths.append(plot_goodput(results, out / "goodput.png"))
    return paths


def no_nan(v: Any) -> Any:
    """NaN (a percentile of nothing) as null, so results.json is standard JSON."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, Mapping):
        return {k: no_nan(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [no_nan(x) for x in v]
    return v


def _jsonable(v: object) -> object:
    if isinstance(v, Path):
        return str(v)
    raise TypeError(f"not JSON-able: {type(v).__name__}")
