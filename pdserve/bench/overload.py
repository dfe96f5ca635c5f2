"""`pdserve bench overload`: ten times the capacity offered to a controller, then normal load.

A controller (`--max-inflight`, `--max-queued`) over fake workers (pdserve.fake) whose decode
takes `--output-len` x `--decode-delay` seconds, so its capacity is max_inflight / that time
(requests per second). With `--max-seqs` the fake engines run that many requests at once and
say so, as real ones do: the controller admits no more than their slots (its default over real
engines), and the capacity is the smaller of the two / that time. `--without prefill|decode`
runs the pool with one worker of the other role only, which then serves every request whole
(the controller's fallback), under the same limits. Phase `overload` offers
`--factor` x capacity (Poisson arrivals, streaming completions) for `--duration` seconds; once
the controller's line has drained, phase `after` offers `--after-factor` x capacity. Each
response is served (200, whole stream), refused (429), timed out in the line (503 from admission
control) or failed (anything else); the controller's RSS is read from /proc throughout. Not a
timed test: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench import cluster, procs, report, scrape
from pdserve.bench.metrics import percentiles
from pdserve.models import resolve_model

OUTCOMES = ("served", "refused", "queue_timeout", "failed")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench overload", description=__doc__.split("\n")[0])
    p.add_argument("--max-inflight", type=int, default=8, help="the controller's --max-inflight")
    p.add_argument("--max-queued", type=int, default=32, help="the controller's --max-queued")
    p.add_argument("--max-seqs", type=int, default=0,
                   help="fake engines: requests run at once, reported as vLLM's --max-num-seqs "
                        "(0: no limit)")
    p.add_argument("--queue-timeout", type=float, default=10.0)
    p.add_argument("--without", choices=("prefill", "decode"), default=None,
                   help="a pool lacking this role: the other serves requests whole (fallback)")
    p.add_argument("--decode-delay", type=float, default=0.02, help="fake workers: s per token")
    p.add_argument("--output-len", type=int, default=50)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--factor", type=float, default=10.0, help="offered load / capacity")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of overload")
    p.add_argument("--after-factor", type=float, default=0.5)
    p.add_argument("--after-duration", type=float, default=15.0)
    p.add_argument("--client-timeout", type=float, default=60.0,
                   help="a served request slower than this counts as failed")
    p.add_argument("--max-outstanding", type=int, default=4000,
                   help="client bound: arrivals beyond this many open requests are skipped")
    p.add_argument("--model", default=None, help="model folder (default: the `tiny` preset)")
    p.add_argument("--out", default=None, help="default: bench-results/overload-<timestamp>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    return p


@dataclass(frozen=True)
class Result:
    phase: str
    outcome: str
    status: int
    latency: float  # s: to the refusal, or to the end of the stream
    retry_after: str | None = None
    in_stream: bool = False  # the failure came as an error event inside a 200 stream
    error: str = ""


def classify(phase: str, status: int, latency: float, headers: dict[str, str], text: str,
             timeout: float) -> Result:
    """One response: its status, headers and body (the SSE text of a 200 stream)."""
    retry = headers.get("retry-after")
    if status != 200:
        msg = _error_message(text)
        if status == 429:
            return Result(phase, "refused", status, latency, retry, error=msg)
        if status == 503 and "queue timeout" in msg:
            return Result(phase, "queue_timeout", status, latency, retry, error=msg)
        return Result(phase, "failed", status, latency, retry, error=msg or text[:200])
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    for e in events:
        if "error" in e:
            msg = e["error"].get("message", "")
            outcome = ("refused" if e["error"].get("code") == 429 else
                       "queue_timeout" if "queue timeout" in msg else "failed")
            return Result(phase, outcome, status, latency, in_stream=True, error=msg)
    finish = [c.get("finish_reason") for e in events for c in e.get("choices", ())]
    if "length" not in finish or not text.rstrip().endswith("data: [DONE]"):
        return Result(phase, "failed", status, latency, error=f"incomplete stream: {finish[-3:]}")
    if latency > timeout:
        return Result(phase, "failed", status, latency, error="slower than the client timeout")
    return Result(phase, "served", status, latency)


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""


def summarize(results: list[Result], phase: str, duration: float) -> dict[str, Any]:
    mine = [r for r in results if r.phase == phase]
    row: dict[str, Any] = {"phase": phase, "offered": len(mine),
                           "offered_per_s": round(len(mine) / max(duration, 1e-9), 1)}
    for o in OUTCOMES:
        row[o] = sum(r.outcome == o for r in mine)
    refusals = [r for r in mine if r.outcome in ("refused", "queue_timeout") and not r.in_stream]
    row["refusals_without_retry_after"] = sum(r.retry_after is None for r in refusals)
    row["in_stream_errors"] = sum(r.in_stream for r in mine)
    row["statuses"] = {str(s): sum(r.status == s for r in mine)
                       for s in sorted({r.status for r in mine})}
    s = [r.latency for r in mine if r.outcome == "refused"]
    row["refusal_ms"] = percentiles(s, (50, 99)) if s else {}
    s = [r.latency for r in mine if r.outcome == "served"]
    row["served_ms"] = percentiles(s, (50, 99)) if s else {}
    row["errors"] = sorted({r.error for r in mine if r.outcome == "failed"})[:5]
    return row


# ---- I/O -------------------------------------------------------------------------------------


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MiB, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


async def _request(session, url: str, payload: dict[str, Any], phase: str,
                   timeout: float) -> Result:
    import aiohttp

    t0 = time.monotonic()
    try:
        async with session.post(url, json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout + 30)) as resp:
            text = await resp.text()
            return classify(phase, resp.status, time.monotonic() - t0,
                            {k.lower(): v for k, v in resp.headers.items()}, text, timeout)
    except (aiohttp.ClientError, TimeoutError) as e:
        return Result(phase, "failed", 0, time.monotonic() - t0, error=repr(e)[:200])


async def _offer(session, url: str, payloads, rate: float, duration: float, phase: str,
                 args: argparse.Namespace, rng: random.Random, results: list[Result]) -> int:
    """Open-loop Poisson arrivals for `duration` s; returns arrivals skipped by the client bound."""
    tasks: set[asyncio.Task] = set()

    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        results.append(task.result())

    skipped = 0
    start = time.monotonic()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        await asyncio.sleep(max(0.0, start + t - time.monotonic()))
        if len(tasks) >= args.max_outstanding:
            skipped += 1
            continue
        task = asyncio.create_task(_request(session, url, next(payloads), phase,
                                            args.client_timeout))
        tasks.add(task)
        task.add_done_callback(done)
    await asyncio.gather(*tasks)
    return skipped


async def _drained(base: str, timeout: float) -> bool:
    """Wait until the controller has nothing running or waiting (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await asyncio.to_thread(scrape.scrape, base)
        if m and not m.get("pdserve_inflight_sequences") and not m.get("pdserve_queued_sequences"):
            return True
        await asyncio.sleep(0.5)
    return False


async def drive(base: str, model: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    rng = random.Random(args.seed)
    service = args.output_len * args.decode_delay
    capacity = running_at_once(args) / service

    def payloads():
        while True:
            prompt = [rng.randrange(10, 200) for _ in range(args.input_len)]
            yield {"model": model, "prompt": prompt, "max_tokens": args.output_len,
                   "temperature": 0, "ignore_eos": True, "stream": True}

    gen = payloads()
    url = base + "/v1/completions"
    results: list[Result] = []
    rss: list[tuple[float, str, float]] = []
    phase = "warmup"
    t0 = time.monotonic()

    async def sample() -> None:
        while True:
            rss.append((round(time.monotonic() - t0, 2), phase, rss_mib(pid)[0]))
            await asyncio.sleep(0.5)

    conn = aiohttp.TCPConnector(limit=args.max_outstanding)
    async with aiohttp.ClientSession(connector=conn) as session:
        sampler = asyncio.create_task(sample())
        try:
            await _offer(session, url, gen, capacity / 2, 2 * service + 1, "warmup", args, rng,
                         results)
            await _drained(base, args.queue_timeout + 2 * service + 10)
            phase = "overload"
            rss_start = rss_mib(pid)[0]
            skipped = await _offer(session, url, gen, args.factor * capacity, args.duration,
                                   "overload", args, rng, results)
            rss_end = rss_mib(pid)[0]
            phase = "drain"
            drained = await _drained(base, args.queue_timeout + 2 * service + 30)
            phase = "after"
            skipped += await _offer(session, url, gen, args.after_factor * capacity,
                                    args.after_duration, "after", args, rng, results)
            rss_after = rss_mib(pid)[0]
        finally:
            sampler.cancel()
    over = [v for _, p, v in rss if p == "overload"]
    middle = over[len(over) // 2] if over else rss_start
    return {"capacity_req_s": round(capacity, 2), "service_s": service,
            "running_at_once": running_at_once(args),
            "rows": [summarize(results, "overload", args.duration),
                     summarize(results, "after", args.after_duration)],
            "skipped_by_client_bound": skipped, "drained_before_after_phase": drained,
            "rss_mib": {"start": round(rss_start, 1), "middle": round(middle, 1),
                        "end": round(rss_end, 1), "after": round(rss_after, 1),
                        "peak_during_overload": round(max(over, default=rss_end), 1),
                        "peak_since_start_vmhwm": round(rss_mib(pid)[1], 1)},
            "rss_samples": rss}


def running_at_once(args: argparse.Namespace) -> int:
    """Requests the controller lets run at once: --max-inflight, or the slots of the worker
    that decodes when fewer."""
    return min(args.max_inflight, args.max_seqs) if args.max_seqs else args.max_inflight


def fake_workers(model: str, decode_delay: float, max_seqs: int) -> cluster.WorkerCmd:
    def cmd(role: str, controller: str, core: str | None, keys: str | None) -> list[str]:
        return [sys.executable, "-m", "pdserve.fake", "worker", "--role", role, "--controller",
                controller, "--model", model, "--decode-delay", str(decode_delay),
                "--max-seqs", str(max_seqs)]
    return cmd


def run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    model = resolve_model(args.model)
    ctl = ["--max-inflight", str(args.max_inflight), "--max-queued", str(args.max_queued),
           "--queue-timeout", str(args.queue_timeout)]
    cfg = cluster.Config("overload", prefill=int(args.without != "prefill"),
                         decode=int(args.without != "decode"))
    with cluster.PdDeployment(cfg, model, out, keys=False, controller_args=ctl,
                              worker_cmd=fake_workers(model, args.decode_delay,
                                                      args.max_seqs)) as dep:
        base = dep.start(args.start_timeout)
        pid = dep.groups()["controller"]
        return asyncio.run(drive(base, model, pid, args))


def markdown(res: dict[str, Any]) -> str:
    r = res["rss_mib"]
    rows = res["rows"]
    capacity = (f"- capacity: {res['capacity_req_s']} req/s (requests run at once: "
                f"{res['running_at_once']}, the smaller of max-inflight and the serving engine's slots / "
                f"{res['service_s']:g} s per request)")
    head = ("| phase | offered (req/s) | served | refused 429 | queue timeout 503 | failed "
            "| refusal p50 / p99 (ms) | served p50 / p99 (ms) |")
    out = ["# pdserve bench overload", "", f"- command: `{res['command']}`", capacity, "", head,
           "|" + "---|" * 8]
    for row in rows:
        ref, srv = row["refusal_ms"], row["served_ms"]
        out.append(f"| {row['phase']} | {row['offered']} ({row['offered_per_s']}) "
                   f"| {row['served']} | {row['refused']} | {row['queue_timeout']} "
                   f"| {row['failed']} | {_pair(ref)} | {_pair(srv)} |")
    rss = (f"Controller RSS (MiB): start {r['start']}, middle {r['middle']}, end of overload "
           f"{r['end']}, after {r['after']}; peak during overload {r['peak_during_overload']} "
           f"(VmHWM since start-up {r['peak_since_start_vmhwm']}).")
    notes = (f"Refusals without Retry-After: "
             f"{sum(x['refusals_without_retry_after'] for x in rows)}; errors inside a 200 "
             f"stream: {sum(x['in_stream_errors'] for x in rows)}; arrivals skipped by the "
             f"client bound: {res['skipped_by_client_bound']}.")
    return "\n".join([*out, "", rss, notes, ""])


def _pair(p: dict[str, float]) -> str:
    return f"{report.fmt_ms(p['p50'])} / {report.fmt_ms(p['p99'])}" if p else "-"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    procs.stop_on_sigterm()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"bench-results/overload-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    res = {"command": "pdserve bench overload " + shlex.join(argv), "date": stamp,
           **run(args, out)}
    (out / "overload.json").write_text(json.dumps(report.no_nan(res), indent=2) + "\n")
    (out / "overload.md").write_text(markdown(res))
    print(markdown(res))
    print(f"results in {out}/ (overload.json, overload.md)")
    return 0
