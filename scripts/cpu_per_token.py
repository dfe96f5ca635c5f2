"""Where a streamed token's CPU goes, and its inter-token gaps by position, in pdserve 1P1D
against vLLM's own server, in alternating rounds (this machine's speed drifts by tens of percent
within minutes, so only a ratio within one round means much).

  .venv/bin/python scripts/cpu_per_token.py [--rounds 2] [--requests 25] [--prompt 300] [--output 64]
                                            [--router]

vLLM's server runs with its engine kept to core 1; pdserve's prefill worker gets core 0, its
decode worker core 1, the controller is not pinned (as `pdserve bench handoff` runs them). Each
round: a few warm-up requests, then sequential greedy streaming requests of random token ids.
Prints, per system, the p50 gap before token 1 (pdserve's handoff), after tokens 1-3, 4-15 and
16 on, and each process's (and its busiest threads') CPU per streamed token, with the core it
last ran on (a process that busy-polls counts its polling too: see its share of a core).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from measure_local_prefill import stream

from pdserve.bench import cluster
from pdserve.models import ensure_model

HZ = os.sysconf("SC_CLK_TCK")
BUCKETS = [("handoff", 0, 1), ("1-3", 1, 4), ("4-15", 4, 16), ("16+", 16, None)]


def threads(groups: dict[str, int]) -> dict[tuple[int, int], tuple[str, str, float, int]]:
    """(pid, tid) -> (child name, thread name, CPU seconds, last core), for every process that
    descends from a child (a worker's engine processes leave its process group)."""
    stats: dict[int, dict[int, tuple[str, list[str]]]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            for task in os.listdir(f"/proc/{entry}/task"):
                stat = Path(f"/proc/{entry}/task/{task}/stat").read_text()
                comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
                stats.setdefault(int(entry), {})[int(task)] = (comm, rest.split())
        except (OSError, ValueError):
            pass  # gone meanwhile
    parent = {pid: int(next(iter(ts.values()))[1][1]) for pid, ts in stats.items()}
    roots = {pid: name for name, pid in groups.items()}

    def owner(pid: int) -> str | None:
        while pid > 1 and pid not in roots:
            pid = parent.get(pid, 0)
        return roots.get(pid)

    out = {}
    for pid, ts in stats.items():
        if (name := owner(pid)) is not None:
            for tid, (comm, f) in ts.items():
                out[(pid, tid)] = (name, comm, (int(f[11]) + int(f[12])) / HZ, int(f[36]))
    return out


def measure(dep: cluster.Deployment, label: str, model: str, args: argparse.Namespace) -> None:
    base = dep.start()
    try:
        rng = random.Random(args.seed)
        prompt = lambda: [rng.randrange(100, 1900) for _ in range(args.prompt)]  # noqa: E731
        for _ in range(3):
            stream(base, model, prompt(), 16)
        before, t0 = threads(dep.groups()), time.monotonic()
        gaps, tokens = [], 0
        for _ in range(args.requests):
            _, g = stream(base, model, prompt(), args.output)
            gaps.append(g)
            tokens += len(g) + 1
        after, wall = threads(dep.groups()), time.monotonic() - t0
    finally:
        dep.stop()
    cells = " | ".join(f"{name} {statistics.median(x for g in gaps for x in g[lo:hi]) * 1e3:.2f}"
                       for name, lo, hi in BUCKETS)
    print(f"\n{label}: {tokens} tokens in {wall:.1f} s; gap p50 (ms) by position: {cells}")
    by_proc: dict[tuple[str, int], list[tuple[float, str, int]]] = {}
    for key, (child, comm, cpu, core) in after.items():
        used = cpu - before.get(key, (child, comm, 0.0, core))[2]
        if used > 0:
            by_proc.setdefault((child, key[0]), []).append((used, comm, core))
    for (child, pid), rows in sorted(by_proc.items(), key=lambda kv: -sum(r[0] for r in kv[1])):
        total = sum(r[0] for r in rows)
        busiest = ", ".join(f"{comm} {used / tokens * 1e6:.0f} (core {core})"
                            for used, comm, core in sorted(rows, reverse=True)[:3])
        print(f"  {child:12} pid {pid:<7} {total / tokens * 1e6:6.0f} us/token "
              f"({total / wall:4.0%} of a core)   {busiest}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=25)
    p.add_argument("--prompt", type=int, default=300, help="prompt tokens")
    p.add_argument("--output", type=int, default=64, help="output tokens")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--router", action="store_true", help="also P then D through vllm-router on "
                   "two vLLM servers with pdserve's connector, on the same cores")
    args = p.parse_args()
    model = str(ensure_model("tiny"))
    with tempfile.TemporaryDirectory(prefix="pdserve-cpu-per-token-") as tmp:
        out = Path(tmp)
        for r in range(args.rounds):
            measure(cluster.VllmDeployment(model, out, core="1"), f"round {r + 1}, vLLM's server",
                    model, args)
            cfg = cluster.Config("1P1D", prefill=1, decode=1, local_threshold=0)
            measure(cluster.PdDeployment(cfg, model, out, cores=[0, 1]),
                    f"round {r + 1}, pdserve 1P1D", model, args)
            if args.router:
                measure(cluster.RouterDeployment(model, out, [0, 1]),
                        f"round {r + 1}, P then D through vllm-router", model, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
