"""A Profile fit from a `pdserve bench` results folder (results.json + raw/<config>-r<rate>.json).

What it reads, per run: each request's prompt and output length, TTFT, inter-token gaps, start
time and end (the client's --save-detailed file), cached prompt tokens where the client recorded
them, the configuration's roles and local-prefill threshold (its name), the CPU each worker's
process group used, and the noise others' jobs made.
- Prefill (a, b, c): prompt tokens computed (prompt - cached) against TTFT, in disaggregated
  configurations without local prefills, at each configuration's lowest rate: least squares on
  the lower envelope (per bin of prompt length, the requests at or under the lower quartile of
  residuals: those that found the queue empty).
  TTFT at the client also holds the HTTP and controller time: it lands in `a`.
- Decode (d0, d1, d2): each request's median gap after the handoff is one decode step; its batch
  is the mean number of requests decoding meanwhile (from every request's decode interval, /
  decode workers: the client does not record which worker decoded what), its KV their prompts
  plus half their outputs.
- Handoff: the first gap after the first token minus the request's own step, median.
- CPU: each run's prefill and decode core use against the model's busy share, as a check.
Not recorded there, so taken from the Profile defaults: the engine's chunk size
(max_num_batched_tokens) and max_num_seqs; also which worker served a request, and per-batch
prefill times (TTFT is a whole request's, queue included).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench import workload
from pdserve.bench.workload import RequestClass
from pdserve.planner.costmodel import Profile

MAX_NOISE = 15.0  # % of a core others used: the bench's own --max-noise default


@dataclass
class Run:
    config: str
    roles: list[str]
    threshold: int | None  # the configuration's @T (None: the controller's default)
    rate: float
    duration: float
    goodput: float
    num_prompts: int
    raw: dict[str, Any]
    cpu: dict[str, Any]
    controller: dict[str, Any]
    idle_cpu: dict[str, Any]

    @property
    def prefill_workers(self) -> int:
        return self.roles.count("prefill")

    @property
    def decode_workers(self) -> int:
        return self.roles.count("decode")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0 and self.decode_workers > 0

    @property
    def noise(self) -> float:
        return float(self.cpu.get("others", {}).get("core_pct", 0.0))

    @property
    def local_prefills(self) -> float:
        return sum(v for k, v in self.controller.items()
                   if k.startswith(("pdserve_local_prefills_total",
                                    "pdserve_routes_total{path=local")))


@dataclass
class Fit:
    profile: Profile
    requests: int  # requests the fit used
    notes: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)  # CPU against the model


def read_results(folder: Path) -> tuple[dict[str, Any], list[Run]]:
    results = json.loads((folder / "results.json").read_text())
    runs = []
    for name, cfg in results.get("configs", {}).items():
        m = re.search(r"@(\d+)", name)
        for r in cfg.get("runs", []):
            path = folder / r["raw"]
            if not path.exists():
                continue
            runs.append(Run(name, list(cfg.get("roles", [])), int(m[1]) if m else None,
                            float(r["rate"]), float(r["duration"]),
                            float(r["summary"]["goodput"]), int(r.get("num_prompts", 0)),
                            json.loads(path.read_text()), r.get("cpu", {}),
                            r.get("controller", {}), cfg.get("idle_cpu", {})))
    return results.get("meta", {}), runs


def workload_of(meta: dict[str, Any]) -> tuple[RequestClass, ...] | None:
    """The request classes the bench sent, from its command line (None: a conversation workload
    with cache hits, which the simulator does not model)."""
    argv = shlex.split(meta.get("command", ""))
    opts: dict[str, str] = {}
    for i, a in enumerate(argv):
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            opts[k] = v
        elif a.startswith("--") and i + 1 < len(argv):
            opts[a] = argv[i + 1]
    if "--mix" in opts:
        return workload.parse_mix(opts["--mix"])
    kind = opts.get("--workload", "mixed")
    if kind == "mixed":
        return workload.MIXED
    if kind == "random":
        return workload.uniform(int(opts.get("--input-len", 1024)),
                                int(opts.get("--output-len", 128)),
                                float(opts.get("--range-ratio", 0.0)))
    return None


def _requests(run: Run) -> dict[str, np.ndarray]:
    r = run.raw
    ok = np.array([not e for e in r["errors"]]) & (np.array(r["output_lens"]) > 0)
    cached = [c or 0 for c in (r.get("cached_tokens") or [0] * len(ok))]
    itls = [list(g) for g in r["itls"]]
    lat = r.get("latencies") or [t + sum(g) for t, g in zip(r["ttfts"], itls)]
    return {"ok": ok, "new": np.array(r["input_lens"]) - np.array(cached),
            "prompt": np.array(r["input_lens"], dtype=float),
            "out": np.array(r["output_lens"], dtype=float), "ttft": np.array(r["ttfts"]),
            "start": np.array(r["start_times"]), "e2e": np.array(lat),
            "gap0": np.array([g[0] if g else np.nan for g in itls]),
            "step": np.array([np.median(g[1:]) if len(g) > 2 else np.nan for g in itls])}


def _lstsq_nonneg(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares, dropping any feature whose coefficient comes out negative."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        neg = [k for k in keep if coef[k] < 0]
        if not neg:
            return coef
        keep.remove(neg[0])
        if not keep:
            return np.zeros(x.shape[1])


def fit_prefill(runs: list[Run], notes: list[str]) -> tuple[float, float, float, int]:
    lowest: dict[str, Run] = {}
    for run in runs:
        if not run.disaggregated:
            continue
        if run.local_prefills and run.threshold is None:
            notes.append(f"{run.config} at {run.rate:g} req/s: local prefills of unknown size; "
                         "left out of the prefill fit")
            continue
        if run.config not in lowest or run.rate < lowest[run.config].rate:
            lowest[run.config] = run
    n_all, t_all = [], []
    for run in lowest.values():
        q = _requests(run)
        keep = q["ok"] & (q["new"] >= (run.threshold or 0))
        n_all += list(q["new"][keep])
        t_all += list(q["ttft"][keep])
    if len(n_all) < 8:
        raise ValueError("too few disaggregated requests to fit prefill times")
    n, t = np.array(n_all, dtype=float), np.array(t_all)
    bins = np.array_split(np.argsort(n), min(12, len(n) // 5))
    lin, err_lin = _lower_envelope(np.c_[np.ones_like(n), n], t, bins)
    quad, err_quad = _lower_envelope(np.c_[np.ones_like(n), n, n * n / 1e3], t, bins)
    if quad[2] > 0 and err_quad < 0.8 * err_lin:
        return float(quad[0]), float(quad[1]), float(quad[2]), len(n)
    return float(lin[0]), float(lin[1]), 0.0, len(n)


def _lower_envelope(x: np.ndarray, t: np.ndarray,
                    bins: list[np.ndarray]) -> tuple[np.ndarray, float]:
    """Fit the requests that waited least: refit, twice, on the points at or under their
    length bin's lower quartile of residuals (a queue only ever adds to TTFT). Returns the
    coefficients and their mean squared residual on the points kept."""
    coef = _lstsq_nonneg(x, t)
    keep: np.ndarray = np.ones(len(t), dtype=bool)
    for _ in range(2):
        res = t - x @ coef
        keep[:] = False
        for b in bins:
            keep[b] = res[b] <= np.percentile(res[b], 25) + 1e-12
        coef = _lstsq_nonneg(x[keep], t[keep])
    return coef, float(np.mean((x[keep] @ coef - t[keep]) ** 2))


def _decode_points(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per request: (median step, mean batch, mean KV tokens of the batch, first gap)."""
    q = _requests(run)
    ok = q["ok"] & ~np.isnan(q["gap0"])
    begin = (q["start"] + q["ttft"] + np.nan_to_num(q["gap0"]))[ok]
    end = (q["start"] + q["e2e"])[ok]
    kv = (q["prompt"] + q["out"] / 2)[ok]
    times = np.r_[begin, end]
    order = np.argsort(times, kind="stable")
    times = times[order]
    count = np.cumsum(np.r_[np.ones_like(begin), -np.ones_like(end)][order])
    kvsum = np.cumsum(np.r_[kv, -kv][order])

    def area(level: np.ndarray, at: np.ndarray) -> np.ndarray:
        steps = np.r_[0.0, np.cumsum(level[:-1] * np.diff(times))]
        k = np.clip(np.searchsorted(times, at, side="right") - 1, 0, len(times) - 1)
        return steps[k] + level[k] * (at - times[k])

    span = np.maximum(end - begin, 1e-9)
    per = max(1, run.decode_workers)
    batch = (area(count, end) - area(count, begin)) / span / per
    kvs = (area(kvsum, end) - area(kvsum, begin)) / span / per
    return q["step"][ok], batch, kvs, q["gap0"][ok]


def fit_profile(folder: Path, *, max_noise: float = MAX_NOISE, seed: Profile | None = None,
                hold_out: frozenset[float] = frozenset()) -> Fit:
    """Fit a Profile from a results folder, leaving out the runs at the `hold_out` rates (to
    validate against); ValueError when it holds too little to fit."""
    meta, runs = read_results(folder)
    notes: list[str] = []
    if hold_out:
        runs = [r for r in runs if r.rate not in hold_out]
        notes.append("held out (not fit): the runs at " + ", ".join(
            f"{x:g}" for x in sorted(hold_out)) + " req/s")
    if not runs:
        raise ValueError(f"{folder}: no runs with their raw per-request files"
                         + (" at the rates not held out" if hold_out else ""))
    quiet = [r for r in runs if r.noise <= max_noise]
    if not quiet and all(_engines_uncounted(r) for r in runs):
        notes.append("the workers' CPU leaves out their engines (an engine core runs in a "
                     "process group of its own) and 'others' counts them: the CPU figures and "
                     "the noise check are unusable for this folder")
        quiet = runs
    elif not quiet:
        notes.append(f"every run had others' jobs using > {max_noise:g}% of a core: the fit "
                     "measures them too")
        quiet = runs
    elif len(quiet) < len(runs):
        notes.append(f"{len(runs) - len(quiet)} noisy runs (others > {max_noise:g}% of a core) "
                     "left out")
    if workload_of(meta) is None:
        notes.append("conversation workload: prefix-cache hits make prompt lengths a poor "
                     "guide where the client did not record cached tokens")
    a, b, c, n_prefill = fit_prefill(quiet, notes)
    steps, batch, kvs, gap0 = [], [], [], []
    for run in quiet:
        if run.disaggregated:
            s, r, k, g = _decode_points(run)
            steps.append(s)
            batch.append(r)
            kvs.append(k)
            gap0.append(g)
    if not steps:
        raise ValueError("no disaggregated configuration to fit decode steps from")
    st, rb, kb, g0 = (np.concatenate(x) for x in (steps, batch, kvs, gap0))
    keep = ~np.isnan(st)
    d = _lstsq_nonneg(np.c_[np.ones(keep.sum()), rb[keep], kb[keep] / 1e3], st[keep])
    base = seed or Profile()
    handoff = max(0.0, float(np.median(g0[keep] - st[keep])))  # the first gap has one step
    prof = replace(base, prefill_base_s=a, prefill_per_token_s=b, prefill_per_token_ctx_s=c,
                   step_base_s=float(d[0]), step_per_running_s=float(d[1]),
                   step_per_kkv_s=float(d[2]), handoff_s=handoff,
                   source=f"pdserve plan fit of {folder}")
    notes.append(f"not in the results, defaults kept: chunk_tokens {prof.chunk_tokens}, "
                 f"max_running {prof.max_running}")
    return Fit(prof, n_prefill + int(keep.sum()), notes, _cpu_checks(quiet, prof))


def _engines_uncounted(run: Run) -> bool:
    """Whether the run's worker groups miss their engines: under load they used almost no CPU
    while 'others' used most of a core or more (bench/procs.py measures process groups)."""
    workers = [v.get("core_pct", 0.0) for k, v in run.cpu.items()
               if k.startswith(("prefill", "decode", "both"))]
    return bool(workers) and max(workers) < 10.0 and run.noise > 50.0


def _cpu_checks(runs: list[Run], p: Profile) -> list[str]:
    """Measured core use of each run's prefill and decode workers against the model's busy
    share (prefill: rate x mean prefill time / workers; decode: the time some stream decoded)."""
    lines = []
    for run in runs:
        if not run.disaggregated or _engines_uncounted(run):
            continue
        q = _requests(run)
        prefill = run.rate * float(np.mean([p.prefill_seconds(int(n)) for n in q["new"]])) \
            / run.prefill_workers
        cpu = {k: v.get("core_pct", 0.0) - run.idle_cpu.get(k, {}).get("core_pct", 0.0)
               for k, v in run.cpu.items() if k.startswith(("prefill", "decode"))}
        pre = [v for k, v in cpu.items() if k.startswith("prefill")]
        dec = [v for k, v in cpu.items() if k.startswith("decode")]
        if pre and dec:
            lines.append(f"{run.config} at {run.rate:g} req/s: prefill CPU {np.mean(pre):.0f}% "
                         f"(model busy {100 * prefill:.0f}%), decode CPU {np.mean(dec):.0f}%")
    return lines
