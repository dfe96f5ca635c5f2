"""What `pdserve bench` sends at each rate, and which client sends it.

- TraceLoad (mixed, random, --mix; shared-prefix with --client vllm): a seeded list of Items
  written as a timed trace that vLLM's benchmark client replays (client.py).
- ChatLoad (multiturn, shared-prefix): a seeded plan of conversations (chats.py) that
  conversations.py sends, feeding replies back and recording cached prompt tokens.
Both return the client's result in the shape metrics.records_from_vllm reads, with the class of
each request. A run follows one rate or, for a trace, a schedule (workload.Schedule): the same
requests, retimed piecewise.
"""

from __future__ import annotations

import abc
import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench import chats, client, workload
from pdserve.bench.metrics import Slo
from pdserve.bench.workload import Pace, Schedule

CLIENT_TIMEOUT = 3600.0  # seconds for one whole run


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the cache-friendly workloads (--workload multiturn|shared-prefix)."""
    g = p.add_argument_group("multiturn and shared-prefix workloads")
    g.add_argument("--system-len", default=None, metavar="MIN[-MAX]",
                   help="tokens of each shared system prompt, rounded down to 16-token chunks "
                        "(default: multiturn 1000, shared-prefix 1000-1500)")
    g.add_argument("--user-len", default=None, metavar="MIN-MAX",
                   help="new user tokens per turn / per question (default: multiturn 100-300, "
                        "shared-prefix 50-150); --output-len sets the tokens of each reply")
    g.add_argument("--turns", default="3-6", metavar="MIN-MAX",
                   help="turns per conversation (multiturn)")
    g.add_argument("--think-time", type=float, default=2.0, metavar="SECONDS",
                   help="mean of the exponential pause between a reply and the next turn "
                        "(multiturn; 0: none)")
    g.add_argument("--prefixes", type=int, default=4,
                   help="how many system prompts the questions share (shared-prefix)")
    g.add_argument("--client", default="pdserve", choices=["pdserve", "vllm"],
                   help="who sends multiturn / shared-prefix: pdserve's conversation runner "
                        "(records cached tokens) or vLLM's client on a timed trace "
                        "(shared-prefix only; no cached-token counts)")


@dataclass(frozen=True)
class Sent:
    run: dict[str, Any]  # client.measured(): the client's "result", "duration", "cpu", ...
    labels: list[str]  # the class of each request, in the result's order
    arrivals: list[float] = field(default_factory=list)  # each one's, where the load knows them


class Load(abc.ABC):
    """A seeded workload and the client that sends it."""

    schedules = False  # whether a run may follow a workload.Schedule

    @abc.abstractmethod
    def describe(self) -> str: ...

    @abc.abstractmethod
    def warm(self, url: str, n: int, seed: int, raw: Path, name: str, log: Path) -> None:
        """n requests at once, unmeasured."""

    @abc.abstractmethod
    def measure(self, url: str, groups: dict[str, int], n: int, pace: Pace, seed: int,
                run: int, raw: Path, name: str, log: Path) -> Sent:
        """n requests arriving at `pace` (a rate, or a schedule, which sets n itself), with CPU
        and controller metrics measured meanwhile; `run` keeps prompts (so cache entries) of
        different runs apart."""


@dataclass(frozen=True)
class TraceLoad(Load):
    make: Callable[[int, float, int], list[workload.Item]]  # (n, rate, seed) -> items
    what: str
    model: str
    slo: Slo
    hash_seed: int  # PYTHONHASHSEED of vLLM's client: fixes the tokens of each hash id
    burstiness: float = 1.0  # of a schedule's arrivals (make() draws a rate's itself)
    schedules = True

    def describe(self) -> str:
        return self.what

    def items(self, n: int, pace: Pace, seed: int) -> list[workload.Item]:
        if not isinstance(pace, Schedule):
            return self.make(n, pace, seed)
        times = workload.piecewise_arrivals(pace, self.burstiness, np.random.default_rng(seed))
        return workload.retime(self.make(len(times), pace.mean_rate, seed), times)

    def warm(self, url: str, n: int, seed: int, raw: Path, name: str, log: Path) -> None:
        items = self.make(n, float("inf"), seed)
        trace = workload.write_trace(items, raw / f"{name}-warmup.jsonl", run=99)
        client.run_client(client.ClientRun(url, self.model, trace, len(items),
                                           raw / f"{name}-warmup.json", self.slo), log,
                          self.hash_seed)

    def measure(self, url: str, groups: dict[str, int], n: int, pace: Pace, seed: int,
                run: int, raw: Path, name: str, log: Path) -> Sent:
        items = self.items(n, pace, seed)
        tag = workload.run_tag(pace)
        trace = workload.write_trace(items, raw / f"trace-{tag}.jsonl", run=run)
        cr = client.ClientRun(url, self.model, trace, len(items), raw / f"{name}-{tag}.json",
                              self.slo, label=f"{name}-{tag}")
        return Sent(client.run_measured(cr, groups, log, self.hash_seed),
                    [it.cls for it in items], [it.arrival for it in items])


@dataclass(frozen=True)
class ChatLoad(Load):
    spec: chats.ChatSpec
    model: str
    burstiness: float
    token_seed: int

    def describe(self) -> str:
        return chats.describe(self.spec)

    def warm(self, url: str, n: int, seed: int, raw: Path, name: str, log: Path) -> None:
        plan = chats.Plan(self.token_seed, 99, tuple(chats.warmup_chats(self.spec, n, seed)))
        self._go(url, plan, raw / f"{name}-warmup-plan.json", raw / f"{name}-warmup.json", log)

    def measure(self, url: str, groups: dict[str, int], n: int, pace: Pace, seed: int,
                run: int, raw: Path, name: str, log: Path) -> Sent:
        assert not isinstance(pace, Schedule), "conversations follow one rate (schedules=False)"
        rate = pace
        convs = chats.make_chats(self.spec, n, rate, self.burstiness, seed)
        plan = chats.Plan(self.token_seed, run, tuple(convs))
        path, result = raw / f"plan-r{rate:g}.json", raw / f"{name}-r{rate:g}.json"
        return Sent(client.measured(url, groups, lambda: self._go(url, plan, path, result, log)),
                    chats.labels(convs, self.spec.kind))

    def _go(self, url: str, plan: chats.Plan, path: Path, result: Path,
            log: Path) -> dict[str, Any]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan.to_json()) + "\n")
        argv = [sys.executable, "-m", "pdserve.bench.conversations", "--plan", str(path),
                "--base-url", url, "--model", self.model, "--result", str(result)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        return client.run_child(argv, result, log, env, CLIENT_TIMEOUT, "the conversation runner")


def classes_from(args: argparse.Namespace) -> tuple[workload.RequestClass, ...]:
    if args.mix:
        return workload.parse_mix(args.mix)
    if args.workload == "random":
        return workload.uniform(args.input_len, args.output_len, args.range_ratio)
    return workload.MIXED


def chat_spec(args: argparse.Namespace) -> chats.ChatSpec:
    base = chats.MULTITURN if args.workload == "multiturn" else chats.SHARED_PREFIX
    multi = base.kind == "multiturn"
    spec = replace(base, output_len=args.output_len, think_s=args.think_time if multi else 0.0,
                   turns=chats.parse_span(args.turns) if multi else (1, 1),
                   prefixes=1 if multi else args.prefixes)
    if args.system_len:
        spec = replace(spec, system_len=chats.parse_span(args.system_len))
    if args.user_len:
        spec = replace(spec, user_len=chats.parse_span(args.user_len))
    return spec.check()


def from_args(args: argparse.Namespace, model: str, slo: Slo) -> Load:
    """The load the arguments ask for; ValueError when they do not fit together or the model."""
    b = args.burstiness
    if args.mix or args.workload not in chats.KINDS:
        classes = classes_from(args)
        return TraceLoad(lambda n, r, s: workload.make_workload(classes, n, r, b, s),
                         workload.describe(classes), model, slo, args.seed, b)
    spec = chat_spec(args)
    limit = _max_positions(model)
    if limit and spec.max_context > limit:
        raise ValueError(f"{spec.kind} reaches {spec.max_context} tokens of context, over the "
                         f"model's {limit}: fewer --turns or shorter --system-len/--user-len")
    if args.client == "pdserve":
        return ChatLoad(spec, model, b, args.seed)
    if spec.kind == "multiturn":
        raise ValueError("multiturn needs --client pdserve: a timed trace cannot feed replies back")
    return TraceLoad(lambda n, r, s: chats.as_items(chats.make_chats(spec, n, r, b, s)),
                     chats.describe(spec), model, slo, args.seed, b)


def _max_positions(model: str) -> int | None:
    try:
        value = json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"]
        return int(value)
    except (OSError, ValueError, KeyError, TypeError):
        return None
