"""`pdserve bench soak`: steady load near capacity while an extra worker joins, drains and dies.

Start `pdserve serve` 1P1D (loopback, CurveZMQ keys, a temp dir of its own) -> greedy references
from the idle pool -> capacity: a closed-loop probe of requests/s, or `--rate` -> open-loop
Poisson arrivals at `--load` x capacity for `--duration` s, with one event every `--cycle` s in
turn: join an extra decode worker, drain it (SIGTERM), join again, kill -9 its process group ->
wait for the requests in flight (bounded) -> stop everything it started.

Every response is judged: whole (finish_reason length or stop, as many tokens as it says), and
greedy ones equal to their reference; a response missing after `--request-timeout` is lost.
RSS and open file descriptors of every process of the pool are sampled every `--sample-every` s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import launcher
from pdserve.bench import cluster, report, scrape
from pdserve.bench.metrics import percentiles
from pdserve.bench.procs import free_port, stop_on_sigterm
from pdserve.models import resolve_model
from pdserve.procfs import alive, children, shm_segments, shm_used, tree, tree_of

logger = logging.getLogger("pdserve.bench.soak")

EVENTS = ("join", "drain", "join", "kill")
OUTCOMES = ("whole", "wrong", "short", "failed", "lost")
# Controller counters reported as increases over the soak.
COUNTERS = ("pdserve_requests_total", "pdserve_retries_total", "pdserve_requests_recovered_total",
            "pdserve_no_worker_rejections_total", "pdserve_admission_rejections_total")
WORDS = ("the of and to in is it that for on with as was be by at this from or an are not have "
         "but which one all were when there can more if will out so up what about into than "
         "them time only some could new other then these two may first any like now over "
         "such our man me even most made after also did many before must through back years "
         "where much your way well down should because each just those people how too little "
         "state good very make world still own see men work long get here between both life "
         "being under never day same another know while last might us great old year off come "
         "since against go came right used take three").split()


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=1200.0, help="seconds of load")
    p.add_argument("--cycle", type=float, default=180.0,
                   help="seconds between events (join, drain, join, kill -9, ...); the first "
                        "comes half a cycle in")
    p.add_argument("--rate", type=float, default=None,
                   help="offered requests/s (default: --load x the probed capacity)")
    p.add_argument("--load", type=float, default=0.8, help="share of the probed capacity")
    p.add_argument("--probe-seconds", type=float, default=25.0)
    p.add_argument("--probe-concurrency", type=int, default=16,
                   help="requests in flight while probing the capacity (closed loop)")
    p.add_argument("--max-concurrency", type=int, default=64,
                   help="client bound: arrivals beyond this many open requests are skipped")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="a request with no whole answer after this long is lost")
    p.add_argument("--prompt-len", default="32-512", help="prompt tokens (or chat words), MIN-MAX")
    p.add_argument("--output-len", default="16-128", help="max_tokens, MIN-MAX")
    p.add_argument("--chat-share", type=float, default=0.5)
    p.add_argument("--stream-share", type=float, default=0.7)
    p.add_argument("--greedy-share", type=float, default=0.2,
                   help="requests that repeat a greedy reference case (checked token for token)")
    p.add_argument("--greedy-cases", type=int, default=12)
    p.add_argument("--sample-every", type=float, default=60.0,
                   help="seconds between RSS / fd samples")
    p.add_argument("--extra-cores", default="1", help="the joined worker's --cores")
    p.add_argument("--join-timeout", type=float, default=600.0,
                   help="how long a joined worker is watched for becoming ready")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="the joined worker's --drain-timeout; its exit is awaited 60 s longer")
    p.add_argument("--keep-shm", action="store_true",
                   help="leave the /dev/shm files the pool's stopped engines left behind "
                        "(reported either way; removed by default)")
    p.add_argument("--model", default=None, help="model folder (default: the `tiny` preset)")
    p.add_argument("--out", default=None,
                   help="folder for soak.json, soak.md and logs/ (or a .json path: the result "
                        "there, the rest beside it); default: bench-results/soak-<timestamp>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    return p


# ---- the schedule and the accounting (pure) ------------------------------------------------


def schedule(duration: float, cycle: float) -> list[tuple[float, str]]:
    """(seconds after the start, event): one per cycle, the first half a cycle in (so a run of n
    cycles holds n events), events in EVENTS order."""
    if cycle <= 0 or duration <= 0:
        return []
    n = int(duration / cycle + 0.5)
    return [(cycle * (k + 0.5), EVENTS[k % len(EVENTS)]) for k in range(min(n, 10_000))]


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise ValueError(f"bad range {text!r}: want MIN-MAX with 1 <= MIN <= MAX")
    return a, b


@dataclass(frozen=True)
class Case:
    """A prompt and its length limit; `api` is "chat" or "completions"."""

    api: str
    prompt: list[int] | str
    max_tokens: int


@dataclass(frozen=True)
class Req:
    case: Case
    stream: bool
    greedy: int | None = None  # index of the greedy reference its answer must equal

    def payload(self, model: str) -> dict[str, Any]:
        c = self.case
        body: dict[str, Any] = {"model": model, "max_tokens": c.max_tokens}
        if c.api == "chat":
            body["messages"] = [{"role": "user", "content": c.prompt}]
        else:
            body["prompt"] = c.prompt
            body["return_token_ids"] = True
        if self.greedy is not None:
            body["temperature"] = 0  # else the model's default: random sampling, no seed
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


class StreamError(Exception):
    """An error event inside a 200 stream."""


@dataclass(frozen=True)
class Answer:
    text: str
    finish: str | None
    tokens: int | None  # usage.completion_tokens
    token_ids: tuple[int, ...] | None = None  # completions only (return_token_ids)
    done: bool = True  # a stream ended with [DONE]


def parse_answer(api: str, stream: bool, body: str) -> Answer:
    """The first choice of a response body (JSON, or a stream's SSE text)."""
    if not stream:
        d = json.loads(body)
        c = d["choices"][0]
        text = c["text"] if api == "completions" else c["message"].get("content") or ""
        ids = c.get("token_ids")
        return Answer(text, c.get("finish_reason"), (d.get("usage") or {}).get("completion_tokens"),
                      None if ids is None else tuple(ids))
    parts: list[str] = []
    ids_seen: list[int] | None = None
    finish, tokens, done = None, None, False
    # Not splitlines(): it also splits at U+0085, U+2028 and others that JSON leaves unescaped
    # in the text (a random model emits them).
    for line in body.split("\n"):
        if not line.startswith("data: "):
            continue
        if line[6:].strip() == "[DONE]":
            done = True
            continue
        e = json.loads(line[6:])
        if "error" in e:
            raise StreamError(str(e["error"].get("message", e["error"]))[:200])
        for c in e.get("choices") or ():
            parts.append((c.get("text") if api == "completions"
                          else (c.get("delta") or {}).get("content")) or "")
            if c.get("token_ids") is not None:
                ids_seen = (ids_seen or []) + list(c["token_ids"])
            finish = c.get("finish_reason") or finish
        if e.get("usage"):
            tokens = e["usage"].get("completion_tokens")
    return Answer("".join(parts), finish, tokens, None if ids_seen is None else tuple(ids_seen),
                  done)


def judge(req: Req, ans: Answer, ref: Answer | None) -> tuple[str, str]:
    """(outcome, detail) of a 200 response: whole, short (cut off, or fewer tokens than it
    says) or wrong (a greedy answer unlike its reference)."""
    if not ans.done:
        return "short", "stream ended without [DONE]"
    if ans.finish not in ("length", "stop"):
        return "short", f"finish_reason {ans.finish!r}"
    if ans.tokens is None:
        return "short", "no usage"
    limit = req.case.max_tokens
    if ans.finish == "length" and ans.tokens != limit or ans.tokens > limit:
        return "short", f"finish {ans.finish} after {ans.tokens} of {limit} tokens"
    if ans.token_ids is not None and len(ans.token_ids) != ans.tokens:
        return "short", f"{len(ans.token_ids)} token ids, usage says {ans.tokens}"
    if ref is not None:
        if ans.token_ids is not None and ref.token_ids is not None:
            same = ans.token_ids == ref.token_ids
        else:
            same = ans.text == ref.text
        if not same or (ans.finish, ans.tokens) != (ref.finish, ref.tokens):
            at = next((i for i, (a, b) in enumerate(zip(ans.text, ref.text)) if a != b),
                      min(len(ans.text), len(ref.text)))
            return "wrong", (f"greedy case {req.greedy} ({'stream' if req.stream else 'whole'}):"
                             f" {ans.tokens} tokens / {ans.finish} vs {ref.tokens} / {ref.finish},"
                             f" text differs from char {at}")
    return "whole", ""


@dataclass
class Tally:
    """Outcomes of the requests of one phase; failures by kind, a few details of each."""

    counts: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    greedy_checked: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, outcome: str, kind: str = "", detail: str = "", greedy: bool = False,
            latency: float = 0.0) -> None:
        assert outcome in OUTCOMES, outcome
        self.counts[outcome] += 1
        if outcome == "failed":
            self.kinds[kind] += 1
        if outcome != "whole":
            key = f"{outcome}: {kind}" if kind else outcome
            seen = self.examples.setdefault(key, [])
            if len(seen) < 5:
                seen.append(detail[:300])
        if greedy and outcome in ("whole", "wrong"):
            self.greedy_checked += 1
        if outcome in ("whole", "wrong"):
            self.latencies.append(latency)

    @property
    def offered(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"offered": self.offered}
        out |= {o: self.counts[o] for o in OUTCOMES}
        out["failed_by_kind"] = dict(self.kinds.most_common())
        out["greedy_checked"] = self.greedy_checked
        lat = percentiles(self.latencies, (50, 99))
        out["latency_ms"] = {k: round(v, 1) for k, v in lat.items()}
        out["examples"] = self.examples
        return out


# ---- processes, from /proc (pdserve/procfs.py reads them) ---------------------------------------


def usage(pid: int, proc: Path = Path("/proc")) -> tuple[int, int] | None:
    """(VmRSS in KiB, open file descriptors) of a live process; None when it is gone."""
    try:
        rss = 0
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
        return rss, len(os.listdir(proc / str(pid) / "fd"))
    except (OSError, ValueError):
        return None


def name_of(pid: int, proc: Path = Path("/proc")) -> str:
    """`serve`, `controller`, `worker decode` (+ its --worker-id), or the program's own name
    (VLLM::EngineCore, resource_tracker, ...)."""
    try:
        args = (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if "pdserve.cli" in args and args.index("pdserve.cli") + 1 < len(args):
        cmd = args[args.index("pdserve.cli") + 1]
        if cmd != "worker":
            return cmd
        opt = {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}
        return " ".join(x for x in ("worker", opt.get("--role", "?"), opt.get("--worker-id"))
                        if x)
    if any("resource_tracker" in a for a in args):
        return "resource_tracker"
    return os.path.basename(args[0]) or "?"


def pool_processes(roots: list[int], proc: Path = Path("/proc")) -> dict[int, str]:
    """Every process under `roots`, named; a child that is not a pdserve command is named after
    its parent too (`worker decode/VLLM::EngineCore`)."""
    names: dict[int, str] = {}

    def walk(pid: int, parent: str) -> None:
        if pid in names or len(names) >= 1000:
            return
        own = name_of(pid, proc)
        names[pid] = own if not parent or own.split()[0] in ("serve", "controller", "worker") \
            else f"{parent}/{own}"
        for c in children(pid, proc):
            walk(c, names[pid])

    for r in roots:
        walk(r, "")
    return names


def sample(roots: list[int], t: float, proc: Path = Path("/proc")) -> dict[str, Any]:
    out: dict[str, Any] = {"t": round(t, 1), "procs": {}}
    for pid, name in pool_processes(roots, proc).items():
        u = usage(pid, proc)
        if u is not None:
            out["procs"][str(pid)] = [name, u[0], u[1]]
    return out


def process_rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each process's first and last sample (RSS in MiB, fds), in order of first appearance."""
    rows: dict[str, dict[str, Any]] = {}
    for s in samples:
        for pid, (name, rss, fds) in s["procs"].items():
            row = rows.setdefault(pid, {"process": name, "pid": int(pid), "first_t": s["t"],
                                        "rss_start_mib": round(rss / 1024, 1), "fds_start": fds,
                                        "rss_max_mib": 0.0})
            if row["process"] == "?":  # sampled just as it started
                row["process"] = name
            row |= {"last_t": s["t"], "rss_end_mib": round(rss / 1024, 1), "fds_end": fds,
                    "rss_max_mib": max(row["rss_max_mib"], round(rss / 1024, 1))}
    return list(rows.values())


def counters(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith(COUNTERS)}


def increase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(counters(after).items())
            if v - before.get(k, 0.0)}


def shm_left(ours: set[str], t0_wall: float, folder: Path = Path("/dev/shm"),
             proc: Path = Path("/proc")) -> dict[str, dict[str, float]]:
    """Those of `ours` (files the pool's processes used) that still exist and that no process
    uses any more: what stopped engines left behind (MiB, and when each was last written, in s
    after `t0_wall`)."""
    now = shm_segments(folder)
    candidates = set(now) & ours
    left = candidates - shm_used(None, folder, proc) if candidates else set()
    return {n: {"mib": round(now[n][0] / 2**20, 1), "t": round(now[n][1] - t0_wall, 1)}
            for n in sorted(left)}


# ---- the workload ----------------------------------------------------------------------------


class Workload:
    """The request mix: chat and completions, streamed or not, with the model's default (random)
    sampling; a share of them repeat a fixed greedy case whose reference answer is known."""

    def __init__(self, args: argparse.Namespace, seed: int):
        self.args = args
        self.plen, self.olen = span(args.prompt_len), span(args.output_len)
        self.rng = random.Random(seed)
        fixed = random.Random(seed + 1)
        self.cases = [self.case(fixed, "chat" if i % 2 else "completions")
                      for i in range(args.greedy_cases)]
        self.refs: dict[int, Answer] = {}

    def case(self, rng: random.Random, api: str) -> Case:
        n = rng.randint(*self.plen)
        prompt: list[int] | str = (" ".join(rng.choice(WORDS) for _ in range(n)) if api == "chat"
                                   else [rng.randrange(4, 2000) for _ in range(n)])
        return Case(api, prompt, rng.randint(*self.olen))

    def next(self) -> Req:
        r = self.rng
        stream = r.random() < self.args.stream_share
        if self.refs and r.random() < self.args.greedy_share:
            i = r.choice(sorted(self.refs))
            return Req(self.cases[i], stream, i)
        return Req(self.case(r, "chat" if r.random() < self.args.chat_share else "completions"),
                   stream)


@dataclass
class Client:
    session: Any  # aiohttp.ClientSession
    base: str
    model: str
    timeout: float

    async def fetch(self, req: Req) -> Answer:
        import aiohttp

        path = "/v1/chat/completions" if req.case.api == "chat" else "/v1/completions"
        async with self.session.post(self.base + path, json=req.payload(self.model),
                                     timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
            body = await r.text()
        if r.status != 200:
            raise HttpError(r.status, _message(body))
        return parse_answer(req.case.api, req.stream, body)

    async def request(self, req: Req, refs: dict[int, Answer], tally: Tally) -> str:
        """Send `req`, judge the answer, count it in `tally`; returns the outcome."""
        import aiohttp

        t0 = time.monotonic()
        outcome, kind, detail = "failed", "", ""
        try:
            ans = await self.fetch(req)
            ref = refs.get(req.greedy) if req.greedy is not None else None
            outcome, detail = judge(req, ans, ref)
        except TimeoutError:  # aiohttp's total timeout, also ServerTimeoutError
            outcome, detail = "lost", f"no answer within {self.timeout:.0f} s"
        except HttpError as e:
            kind, detail = f"HTTP {e.status}", e.message
        except StreamError as e:
            kind, detail = "error in stream", str(e)
        except aiohttp.ClientError as e:
            kind, detail = type(e).__name__, str(e)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            kind = "unreadable response"
            detail = f"{req.case.api}{' stream' if req.stream else ''}: {e!r}"
        tally.add(outcome, kind, detail, req.greedy is not None, time.monotonic() - t0)
        return outcome


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


def _message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return body[:200]


async def references(client: Client, work: Workload) -> dict[str, Any]:
    """Each greedy case from the idle pool, whole and then streamed: the two must agree (else
    the case is dropped) and become the answer every later repeat must give."""
    unstable = []
    for i, case in enumerate(work.cases):
        whole = await client.fetch(Req(case, False, i))
        streamed = await client.fetch(Req(case, True, i))
        verdict = judge(Req(case, False, i), whole, None)
        if verdict[0] == "whole":
            verdict = judge(Req(case, True, i), streamed, whole)
        if verdict[0] == "whole":
            work.refs[i] = whole
        else:
            unstable.append(f"case {i}: {verdict[0]}: {verdict[1]}")
    return {"cases": len(work.refs), "unstable": unstable}


async def probe(client: Client, work: Workload, seconds: float, concurrency: int,
                tally: Tally) -> float:
    """Whole answers per second with `concurrency` requests always in flight (closed loop)."""
    end = time.monotonic() + seconds
    done = 0

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < end:
            if await client.request(work.next(), work.refs, tally) == "whole" \
                    and time.monotonic() <= end:
                done += 1

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / seconds


@dataclass
class Arrivals:
    open: int = 0  # requests sent and not answered yet
    skipped: int = 0  # arrivals dropped because `cap` requests were open


async def offer(client: Client, work: Workload, rate: float, seconds: float, cap: int,
                tally: Tally, rng: random.Random, arrivals: Arrivals) -> None:
    """Poisson arrivals at `rate` for `seconds`, then wait for the answers (each bounded by the
    client's timeout)."""
    tasks: set[asyncio.Task] = set()

    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        arrivals.open = len(tasks)

    start = time.monotonic()
    t = rng.expovariate(rate)
    while t < seconds:
        await asyncio.sleep(max(0.0, start + t - time.monotonic()))
        if len(tasks) >= cap:
            arrivals.skipped += 1
        else:
            task = asyncio.create_task(client.request(work.next(), work.refs, tally))
            tasks.add(task)
            arrivals.open = len(tasks)
            task.add_done_callback(done)
        t += rng.expovariate(rate)
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=client.timeout + 30)
        for task in pending:  # not expected: each request has its own timeout
            task.cancel()
            tally.add("lost", detail="still open after the client's timeout")


# ---- the pool and its events -----------------------------------------------------------------


def workers(base: str) -> dict[str, dict[str, Any]]:
    """The controller's /pd/workers by worker id ({} when it does not answer)."""
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/pd/workers", timeout=5) as r:
            return {w["id"]: w for w in json.loads(r.read())}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def stop_tree(child: launcher.Child, grace: float) -> list[int]:
    """SIGTERM `child`'s process group, wait up to `grace` s, then SIGKILL the group and every
    process that was under it (engines keep to groups of their own); returns the pids that
    needed that SIGKILL."""
    snap = tree(child.proc.pid)
    if child.proc.poll() is None:
        child.signal_group(signal.SIGTERM)
        try:
            child.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    child.signal_group(signal.SIGKILL)
    left = [p for p in dict.fromkeys(snap + tree(child.proc.pid)) if alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        child.proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    return left


class Pool:
    """`pdserve serve` 1P1D and the extra decode worker that comes and goes. Every process it
    starts leads a session of its own and is stopped together with all its descendants."""

    def __init__(self, model: str, tmp: Path, logdir: Path, args: argparse.Namespace):
        from pdserve.transport import keygen

        self.model, self.logdir, self.args = model, logdir, args
        self.keys = str(tmp / "keys")
        keygen(self.keys)
        self.port, self.wport = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = cluster.bench_env(tmp)
        self.serve: launcher.Child | None = None
        self.extra: launcher.Child | None = None
        self.leaving: list[launcher.Child] = []  # drained or killed, until stopped
        self.joins = 0
        logdir.mkdir(parents=True, exist_ok=True)

    def _spawn(self, name: str, cmd: list[str]) -> launcher.Child:
        with open(self.logdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        return launcher.Child(name, proc)

    def start(self, timeout: float) -> None:
        # serve keeps its two workers to a core each (0 and 1 here) and drains them on SIGTERM.
        self.serve = self._spawn("serve", [
            sys.executable, "-m", "pdserve.cli", "serve", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--worker-port", str(self.wport),
            "--keys", self.keys, "--drain-timeout", "30"])
        launcher.wait_ready(self.base, 2, [self.serve], timeout)

    def join(self) -> launcher.Child:
        self.joins += 1
        wid = f"decode-soak-{self.joins}"
        self.extra = self._spawn(wid, launcher.worker_command(
            "decode", f"tcp://127.0.0.1:{self.wport}", self.model, self.args.extra_cores,
            self.keys, ["--worker-id", wid, "--drain-timeout", str(self.args.drain_timeout)]))
        return self.extra

    def release(self) -> launcher.Child | None:
        """The extra worker, now counted as leaving."""
        c, self.extra = self.extra, None
        if c is not None:
            self.leaving.append(c)
        return c

    def roots(self) -> list[int]:
        return [c.proc.pid for c in (self.serve, self.extra, *self.leaving)
                if c is not None and alive(c.proc.pid)]

    def stop(self) -> None:
        for c in (self.extra, *self.leaving):
            if c is not None:
                stop_tree(c, 30)
        self.extra, self.leaving = None, []
        if self.serve is not None:
            stop_tree(self.serve, 120)
            self.serve = None


class Chaos:
    """Runs the event schedule against the pool; each event's entry gets what followed it."""

    def __init__(self, pool: Pool, args: argparse.Namespace, t0: float,
                 events: list[dict[str, Any]], shm_ours: set[str]):
        self.pool, self.args, self.t0, self.events = pool, args, t0, events
        self.shm_ours = shm_ours  # /dev/shm files the victims used are noted here
        self.watchers: set[asyncio.Task] = set()
        self.join_entry: dict[str, Any] = {}  # the last join's, filled in by its watcher

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    async def run(self, plan: list[tuple[float, str]], cycle: float) -> None:
        actions = {"join": self.join, "drain": self.drain, "kill": self.kill}
        for t, what in plan:
            await asyncio.sleep(max(0.0, self.t0 + t - time.monotonic()))
            waited = 0.0
            if what != "join":
                # Draining or killing a worker still loading its engine tests little: give it
                # up to half a cycle to become ready.
                waited = await self.until_ready(cycle / 2)
            entry: dict[str, Any] = {"t": self.now(), "event": what}
            if waited >= 1:
                entry["waited_for_ready_s"] = round(waited, 1)
            self.events.append(entry)
            await actions[what](entry)
            logger.info("%.0f s: %s %s", entry["t"], what, entry.get("worker", ""))

    async def until_ready(self, bound: float) -> float:
        """Seconds waited (at most `bound`) for the last join's watcher to have its result
        (ready, exited, or given up)."""
        t0 = time.monotonic()
        while (self.pool.extra is not None and "result" not in self.join_entry
               and time.monotonic() - t0 < bound):
            await asyncio.sleep(0.5)
        return time.monotonic() - t0

    async def settle(self, timeout: float) -> None:
        """Let the watchers of the last events finish (bounded), then stop them."""
        if self.watchers:
            _, pending = await asyncio.wait(set(self.watchers), timeout=timeout)
            for w in pending:
                w.cancel()

    def watch(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.watchers.add(task)
        task.add_done_callback(self.watchers.discard)

    async def _state(self, entry: dict[str, Any], wid: str) -> None:
        w = (await asyncio.to_thread(workers, self.pool.base)).get(wid, {})
        entry["state"] = w.get("state", "absent")
        entry["inflight"] = w.get("inflight", 0)

    async def join(self, entry: dict[str, Any]) -> None:
        if self.pool.extra is not None:  # its join failed to leave; not expected
            entry["note"] = f"{self.pool.extra.name} still there: killed first"
            left = self.pool.release()
            if left is not None:
                await asyncio.to_thread(stop_tree, left, 0)
        c = self.pool.join()
        entry |= {"worker": c.name, "pid": c.proc.pid}
        self.join_entry = entry
        self.watch(self._ready(c, entry))

    async def _ready(self, c: launcher.Child, entry: dict[str, Any]) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.args.join_timeout:
            if c is not self.pool.extra:
                waited = time.monotonic() - t0
                entry["result"] = f"not ready when the next event came ({waited:.0f} s)"
                return
            if c.proc.poll() is not None:
                entry["result"] = f"exited with code {c.proc.returncode} before it was ready"
                return
            if (await asyncio.to_thread(workers, self.pool.base)).get(c.name, {}).get(
                    "state") == "ready":
                entry["ready_after_s"] = round(time.monotonic() - t0, 1)
                entry["result"] = f"ready after {entry['ready_after_s']:.0f} s"
                return
            await asyncio.sleep(0.5)
        entry["result"] = f"not ready after {self.args.join_timeout:.0f} s"

    async def _take_extra(self, entry: dict[str, Any]) -> tuple[launcher.Child, list[int]] | None:
        """The joined worker and its process tree, its state noted in `entry`; None if none."""
        c = self.pool.release()
        if c is None:
            entry["result"] = "skipped: no extra worker"
            return None
        entry |= {"worker": c.name, "pid": c.proc.pid}
        snap = tree(c.proc.pid)
        self.shm_ours |= shm_used(snap)
        await self._state(entry, c.name)
        return c, snap

    async def drain(self, entry: dict[str, Any]) -> None:
        taken = await self._take_extra(entry)
        if taken is None:
            return
        c, snap = taken
        c.signal_group(signal.SIGTERM)
        self.watch(self._drained(c, snap, entry))

    async def _drained(self, c: launcher.Child, snap: list[int], entry: dict[str, Any]) -> None:
        t0 = time.monotonic()
        bound = self.args.drain_timeout + 60
        while c.proc.poll() is None and time.monotonic() - t0 < bound:
            await asyncio.sleep(0.5)
        if c.proc.poll() is None:
            killed = await asyncio.to_thread(stop_tree, c, 0)
            entry["result"] = f"still running after {bound:.0f} s: SIGKILLed {len(killed)}"
            return
        took = time.monotonic() - t0
        entry["result"] = f"exited with code {c.proc.returncode} after {took:.1f} s"
        left = await asyncio.to_thread(workers, self.pool.base)
        entry["in_pool_after"] = left.get(c.name, {}).get("state", "gone")
        await asyncio.sleep(5.0)
        entry["result"] += orphans(snap)

    async def kill(self, entry: dict[str, Any]) -> None:
        taken = await self._take_extra(entry)
        if taken is None:
            return
        c, snap = taken
        c.signal_group(signal.SIGKILL)  # the worker's group; its engine is to follow by itself
        self.watch(self._killed(c, snap, entry))

    async def _killed(self, c: launcher.Child, snap: list[int], entry: dict[str, Any]) -> None:
        t0 = time.monotonic()
        entry["controller_saw"] = "still ready after 60 s"
        while time.monotonic() - t0 < 60:
            state = (await asyncio.to_thread(workers, self.pool.base)).get(c.name, {}).get(
                "state", "gone")
            if state != "ready":
                entry["controller_saw"] = f"{state} after {time.monotonic() - t0:.1f} s"
                break
            await asyncio.sleep(0.2)
        while c.proc.poll() is None and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.2)
        await asyncio.sleep(max(0.0, t0 + 5.0 - time.monotonic()))
        entry["result"] = f"{len(snap)} processes killed" + orphans(snap)


def orphans(snap: list[int]) -> str:
    """SIGKILL what is still alive of `snap` (a stopped worker's processes); say what it was."""
    left = {p: name_of(p) for p in snap if alive(p)}
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return f"; ORPHANS left, SIGKILLed: {sorted(left.values())}" if left else "; no orphan"


# ---- the run ---------------------------------------------------------------------------------


class Soak:
    """One soak: its pool, load and events; `result()` is what was measured so far."""

    def __init__(self, args: argparse.Namespace, model: str, out: Path, tmp: Path):
        self.args, self.model = args, model
        self.pool = Pool(model, tmp, out / "logs", args)
        self.work = Workload(args, args.seed)
        self.tally, self.probe_tally = Tally(), Tally()
        self.arrivals = Arrivals()
        # /dev/shm files the pool's processes were seen using (engines talk through some).
        self.shm_ours: set[str] = set()
        self.res: dict[str, Any] = {"events": [], "samples": []}

    def result(self) -> dict[str, Any]:
        res = dict(self.res)
        res["tally"] = self.tally.summary()
        res["skipped_by_cap"] = self.arrivals.skipped
        if "capacity" in res and res["capacity"]:
            res["capacity"]["probe"] = self.probe_tally.summary()
        res["processes"] = process_rows(res["samples"])
        return res

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Client]:
        """A client with connections of its own, all closed on leaving (so that the open file
        descriptors sampled before and after the load do not count the client's connections)."""
        import aiohttp

        conn = aiohttp.TCPConnector(
            limit=max(self.args.max_concurrency, self.args.probe_concurrency) + 8)
        async with aiohttp.ClientSession(connector=conn) as session:
            yield Client(session, self.pool.base, self.model, self.args.request_timeout)
        await asyncio.sleep(2.0)  # the server closes its ends

    async def drive(self) -> None:
        args, res = self.args, self.res
        async with self.client() as client:
            res["references"] = await references(client, self.work)
            logger.info("greedy references: %d cases (%d unstable)",
                        res["references"]["cases"], len(res["references"]["unstable"]))
            if args.rate:
                rate = args.rate
                res["capacity"] = None
            else:
                cap = await probe(client, self.work, args.probe_seconds, args.probe_concurrency,
                                  self.probe_tally)
                res["capacity"] = {"req_s": round(cap, 2), "probe_s": args.probe_seconds,
                                   "concurrency": args.probe_concurrency}
                rate = args.load * cap
                logger.info("capacity %.2f req/s (closed loop, %d in flight)", cap,
                            args.probe_concurrency)
                if rate <= 0:
                    raise RuntimeError("the capacity probe got no whole answer")
        res["rate_req_s"] = round(rate, 3)
        before = await asyncio.to_thread(scrape.scrape, self.pool.base)
        t0 = time.monotonic()
        res["t0_wall"] = time.time()
        res["samples"].append(await asyncio.to_thread(self.sample, 0.0))
        chaos = Chaos(self.pool, args, t0, res["events"], self.shm_ours)
        tasks = [asyncio.create_task(chaos.run(schedule(args.duration, args.cycle), args.cycle)),
                 asyncio.create_task(self.sampler(t0))]
        try:
            async with self.client() as client:
                await offer(client, self.work, rate, args.duration, args.max_concurrency,
                            self.tally, random.Random(args.seed + 2), self.arrivals)
        finally:
            res["duration_s"] = round(time.monotonic() - t0, 1)
            for task in tasks:
                task.cancel()
        await chaos.settle(60)
        after = await asyncio.to_thread(scrape.scrape, self.pool.base)
        res["controller"] = increase(before, after)
        res["samples"].append(await asyncio.to_thread(self.sample, time.monotonic() - t0))
        res["workers_end"] = [
            {k: w.get(k) for k in ("id", "role", "state", "inflight", "legs_total")}
            for w in (await asyncio.to_thread(workers, self.pool.base)).values()]

    def sample(self, t: float) -> dict[str, Any]:
        """RSS and fds of every process of the pool; notes the /dev/shm files they use."""
        s = sample(self.pool.roots(), t)
        self.shm_ours |= shm_used([int(p) for p in s["procs"]])
        return s

    async def sampler(self, t0: float) -> None:
        seen = 0
        while True:
            await asyncio.sleep(self.args.sample_every)
            s = await asyncio.to_thread(self.sample, time.monotonic() - t0)
            left = await asyncio.to_thread(shm_left, self.shm_ours, 0.0)
            c, recent = self.tally.counts, self.tally.latencies[seen:]
            seen += len(recent)
            p99 = percentiles(recent, (99,))["p99"]
            s |= {"counts": dict(c), "open": self.arrivals.open,
                  "skipped": self.arrivals.skipped, "p99_ms_since_last": round(p99, 1),
                  "shm_left_mib": round(sum(v["mib"] for v in left.values()), 1)}
            self.res["samples"].append(s)
            logger.info("%.0f s: %d answered (whole %d, wrong %d, short %d, failed %d, lost %d), "
                        "%d open, %d skipped; p99 since the last sample %s ms; %d processes",
                        s["t"], self.tally.offered, c["whole"], c["wrong"], c["short"],
                        c["failed"], c["lost"], self.arrivals.open, self.arrivals.skipped,
                        report.fmt_ms(p99), len(s["procs"]))


def markdown(res: dict[str, Any]) -> str:
    t = res.get("tally", {})
    out = ["# pdserve bench soak", "", f"- command: `{res.get('command', '')}`",
           f"- model: `{res.get('model', '')}`"]
    if res.get("interrupted"):
        out.append("- INTERRUPTED: requests in flight then are not counted")
    if res.get("error"):
        out.append(f"- ERROR: {res['error']}")
    if "startup_s" in res:
        out.append(f"- pool ready in {res['startup_s']:.0f} s (1P1D, workers on cores 0 and 1; "
                   f"the extra decode worker on core(s) {res['args']['extra_cores']})")
    if refs := res.get("references"):
        out.append(f"- greedy references: {refs['cases']} cases"
                   + (f"; dropped as unstable: {refs['unstable']}" if refs["unstable"] else ""))
    cap = res.get("capacity")
    if cap:
        p = cap.get("probe", {})
        out.append(f"- capacity: {cap['req_s']} req/s (closed loop, {cap['concurrency']} in "
                   f"flight, {cap['probe_s']:g} s; probe answers: {p.get('whole', 0)} whole, "
                   f"{p.get('offered', 0) - p.get('whole', 0)} not)")
    if "rate_req_s" in res:
        share = f" ({res['args']['load']:.0%} of capacity)" if cap else " (given)"
        out.append(f"- offered rate: {res['rate_req_s']} req/s{share}, Poisson, at most "
                   f"{res['args']['max_concurrency']} open")
    if t:
        lat = t["latency_ms"]
        out += [f"- duration: {res.get('duration_s', 0):.0f} s of load (arrivals for "
                f"{res['args']['duration']:g} s, then the answers in flight)",
                f"- offered {t['offered']} (skipped by the client bound: "
                f"{res.get('skipped_by_cap', 0)}): completed whole {t['whole']}, wrong "
                f"{t['wrong']}, short {t['short']}, failed {t['failed']}, lost {t['lost']}",
                f"- greedy answers checked against their reference: {t['greedy_checked']}",
                f"- failed by kind: {t['failed_by_kind'] or 'none'}",
                f"- latency of answers p50 / p99: {report.fmt_ms(lat.get('p50'))} / "
                f"{report.fmt_ms(lat.get('p99'))} ms"]
        for key, ex in t["examples"].items():
            out.append(f"  - {key}: {ex[:3]}")
    if "shm_left" in res:
        left = res["shm_left"]
        out.append(f"- /dev/shm files the pool's processes used, still there once everything "
                   f"stopped and used by no process: {len(left)} "
                   f"({sum(v['mib'] for v in left.values()):,.0f} MiB)"
                   + "".join(f"; {n} {v['mib']:.0f} MiB written at {v['t']:.0f} s"
                             for n, v in left.items())
                   + ("" if res["args"].get("keep_shm") or not left else "; removed"))
    if "controller" in res:
        ctl = ", ".join(f"{k} +{v:g}" for k, v in res["controller"].items()) or "no change"
        out.append(f"- controller /metrics over the soak: {ctl}")
    out += ["", "## Events", "", "| t (s) | event | worker | state then | result |",
            "|---|---|---|---|---|"]
    for e in res.get("events", []):
        extra = "; ".join(str(e[k]) for k in ("note", "in_pool_after", "controller_saw")
                          if k in e)
        if "waited_for_ready_s" in e:
            extra += f"{'; ' if extra else ''}came {e['waited_for_ready_s']:.0f} s late, " \
                     "waiting for the worker to be ready"
        state = f"{e['state']}, {e.get('inflight', 0)} in flight" if "state" in e else ""
        out.append(f"| {e['t']:.0f} | {e['event']} | {e.get('worker', '')} | {state} "
                   f"| {e.get('result', '(pending)')}{'; ' + extra if extra else ''} |")
    progress = [s for s in res.get("samples", []) if "counts" in s]
    if progress:
        out += ["", "## Progress", "",
                "| t (s) | answered | not whole | open | skipped | p99 since the last (ms) "
                "| /dev/shm left by stopped engines (MiB) |", "|---|---|---|---|---|---|---|"]
        for s in progress:
            n = sum(s["counts"].values())
            out.append(f"| {s['t']:.0f} | {n} | {n - s['counts'].get('whole', 0)} | {s['open']} "
                       f"| {s['skipped']} | {report.fmt_ms(s['p99_ms_since_last'])} "
                       f"| {s.get('shm_left_mib', 0):,.0f} |")
    out += ["", "## Processes (RSS and open file descriptors, first and last sample)", "",
            "| process | pid | RSS start / end / max (MiB) | fds start / end | sampled (s) |",
            "|---|---|---|---|---|"]
    for r in res.get("processes", []):
        out.append(f"| {r['process']} | {r['pid']} | {r['rss_start_mib']:.1f} / "
                   f"{r['rss_end_mib']:.1f} / {r['rss_max_mib']:.1f} | {r['fds_start']} / "
                   f"{r['fds_end']} | {r['first_t']:.0f}-{r['last_t']:.0f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    try:
        span(args.prompt_len), span(args.output_len)
    except ValueError as e:
        print(f"pdserve bench soak: {e}", file=sys.stderr)
        return 2
    stop_on_sigterm()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = Path(args.out or f"bench-results/soak-{stamp}")
    out, result_path = ((target.parent, target) if target.suffix == ".json"
                        else (target, target / "soak.json"))
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    soak = Soak(args, model, out, tmp)
    soak.res |= {"command": "pdserve bench soak " + shlex.join(argv), "date": stamp,
                 "model": model, "args": vars(args)}
    status = 0
    try:
        t0 = time.monotonic()
        logger.info("starting pdserve serve 1P1D (logs in %s)", out / "logs")
        soak.pool.start(args.start_timeout)
        soak.res["startup_s"] = round(time.monotonic() - t0, 1)
        asyncio.run(soak.drive())
    except KeyboardInterrupt:
        soak.res["interrupted"] = True
        status = 130
    except (RuntimeError, TimeoutError, OSError) as e:
        logger.error("soak failed: %s", e)
        soak.res["error"] = str(e)
        status = 1
    finally:
        # Stop everything it started even when interrupted again meanwhile (bounded: ~3 min).
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        soak.shm_ours |= shm_used(tree_of(soak.pool.roots()))
        soak.pool.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        soak.res["shm_left"] = left = shm_left(soak.shm_ours, soak.res.get("t0_wall", 0.0))
        if not args.keep_shm:
            for name in left:
                Path("/dev/shm", name).unlink(missing_ok=True)
        res = soak.result()
        result_path.write_text(json.dumps(report.no_nan(res), indent=2) + "\n")
        (out / "soak.md").write_text(markdown(res))
        print(markdown(res))
        print(f"results in {result_path} and {out / 'soak.md'}; logs in {out / 'logs'}/")
    return status
