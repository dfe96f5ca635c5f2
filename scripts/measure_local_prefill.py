"""Measures what --local-prefill-threshold trades: per prompt length, the TTFT of a request
prefilled on its decode worker (local) against one handed over from a prefill worker, and the
decode engine's step time (what a local prefill of that length holds other streams up by).

  .venv/bin/python scripts/measure_local_prefill.py [--preset tiny|bench] [--reps 5]

Starts `pdserve serve` twice (all local, then all disaggregated) on this machine; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from pdserve.net import free_port

LENGTHS = [16, 64, 128, 256, 512, 1024, 2000]


def stream(base: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    times = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


def run(model: str, local: bool, reps: int) -> dict[int, tuple[float, float]]:
    port, wport = free_port(), free_port()
    threshold = "100000" if local else "0"
    with tempfile.TemporaryDirectory() as tmp:
        log = open(os.path.join(tmp, "serve.log"), "w")
        p = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--model", model,
                              "--port", str(port), "--worker-port", str(wport),
                              f"--controller-arg=--local-prefill-threshold={threshold}"],
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            for _ in range(600):
                if "pdserve ready" in open(log.name).read():
                    break
                time.sleep(1)
            rng = random.Random(0)
            out = {}
            for n in LENGTHS:
                ttfts, gaps = [], []
                for i in range(reps + 1):
                    prompt = [rng.randrange(4, 2000) for _ in range(n)]
                    ttft, g = stream(base, model, prompt, 16)
                    if i:  # the first of each length warms up
                        ttfts.append(ttft)
                        gaps += g
                out[n] = (statistics.median(ttfts), statistics.median(gaps))
            return out
        finally:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    from pdserve.models import ensure_model

    model = str(ensure_model(a.preset))
    local = run(model, True, a.reps)
    disagg = run(model, False, a.reps)
    print(f"preset {a.preset}: median of {a.reps} requests per length, 16 output tokens")
    print("| prompt tokens | TTFT local (ms) | TTFT P/D (ms) | handoff cost (ms) | "
          "decode step (ms) | local prefill = decode steps |")
    print("|---|---|---|---|---|---|")
    for n in LENGTHS:
        tl, step = local[n]
        td, _ = disagg[n]
        print(f"| {n} | {tl * 1e3:.1f} | {td * 1e3:.1f} | {(td - tl) * 1e3:.1f} | "
              f"{step * 1e3:.1f} | {tl / step:.1f} |")


if __name__ == "__main__":
    main()
