"""Cache-friendly workloads (pure, seeded): growing conversations, and questions behind a few
shared system prompts.

Both are lists of `Conversation`s, each a system prompt (one of `prefixes` shared ones) and turns:
- multiturn: one shared system prompt; turn k's prompt is turn k-1's prompt + its reply + new
  user tokens, so turn k+1 waits for turn k's answer and a think time (conversations.py sends
  them). The rate is requests/s overall: conversations start as a Poisson process at
  rate / (mean turns per conversation), so n = rate x duration requests start over ~duration.
- shared-prefix: one-turn conversations, each behind one of a few system prompts; Poisson
  arrivals at the rate. `as_items` also makes it a timed trace for vLLM's client, whose prompts
  share their leading tokens wherever they share leading hash ids (workload.write_trace).
Token ids follow from (seed, run, what they are) alone, so a plan is only lengths and times.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from pdserve.bench.workload import CHUNK, Item, arrivals

KINDS = ("multiturn", "shared-prefix")


@dataclass(frozen=True)
class ChatSpec:
    kind: str  # one of KINDS
    system_len: tuple[int, int]  # tokens of each shared system prompt, uniform in [min, max]
    user_len: tuple[int, int]  # new user tokens per turn
    output_len: int  # tokens of each reply (EOS ignored)
    turns: tuple[int, int] = (1, 1)  # turns per conversation
    think_s: float = 0.0  # mean of the exponential pause between a reply and the next turn
    prefixes: int = 1  # how many system prompts there are

    def check(self) -> ChatSpec:
        for name, (lo, hi) in (("system", self.system_len), ("user", self.user_len),
                               ("turns", self.turns)):
            if not 1 <= lo <= hi:
                raise ValueError(f"bad {name} range {lo}-{hi}: want 1 <= MIN <= MAX")
        if self.kind not in KINDS or self.output_len < 1 or self.think_s < 0 or self.prefixes < 1:
            raise ValueError(f"bad chat workload {self}")
        return self

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2

    @property
    def max_context(self) -> int:
        """The most tokens a request can reach, prompt and reply (the last turn of the longest
        conversation)."""
        return self.system_len[1] + self.turns[1] * (self.user_len[1] + self.output_len)


MULTITURN = ChatSpec("multiturn", (1000, 1000), (100, 300), 128, turns=(3, 6), think_s=2.0)
SHARED_PREFIX = ChatSpec("shared-prefix", (1000, 1500), (50, 150), 128, prefixes=4)


@dataclass(frozen=True)
class Turn:
    user_len: int
    output_len: int
    think: float  # seconds between the previous reply and this turn (0 for the first turn)


@dataclass(frozen=True)
class Conversation:
    index: int
    prefix: int  # which shared system prompt
    system_len: int
    start: float  # seconds after the first conversation may start
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Plan:
    """What one run sends; `run` keeps token ids (and so cache entries) of runs apart."""

    seed: int
    run: int
    conversations: tuple[Conversation, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> Plan:
        convs = tuple(Conversation(c["index"], c["prefix"], c["system_len"], c["start"],
                                   tuple(Turn(**t) for t in c["turns"]))
                      for c in d["conversations"])
        return Plan(d["seed"], d["run"], convs)


def parse_span(text: str) -> tuple[int, int]:
    """`MIN-MAX` or `N`."""
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"bad range {text!r}: want MIN-MAX or N") from None
    if not 1 <= a <= b:
        raise ValueError(f"bad range {text!r}: want 1 <= MIN <= MAX")
    return a, b


def whole_chunks(n: int) -> int:
    """n rounded down to whole hash-id chunks, so that the hash ids a trace shares cover
    exactly the system prompt."""
    return max(CHUNK, n - n % CHUNK)


def make_chats(spec: ChatSpec, n: int, rate: float, burstiness: float,
               seed: int) -> list[Conversation]:
    """Conversations holding n requests in all (the last one cut short to make n exactly)."""
    spec.check()
    rng = random.Random(seed)
    systems = [whole_chunks(rng.randint(*spec.system_len)) for _ in range(spec.prefixes)]
    counts: list[int] = []
    left = n
    while left > 0:
        counts.append(min(rng.randint(*spec.turns), left))
        left -= counts[-1]
    starts = arrivals(len(counts), rate / spec.mean_turns, burstiness,
                      np.random.default_rng(seed))
    out = []
    for i, (k, start) in enumerate(zip(counts, starts)):
        turns = tuple(Turn(rng.randint(*spec.user_len), spec.output_len,
                           rng.expovariate(1 / spec.think_s) if t and spec.think_s else 0.0)
                      for t in range(k))
        g = rng.randrange(spec.prefixes)
        out.append(Conversation(i, g, systems[g], start, turns))
    return out


def warmup_chats(spec: ChatSpec, n: int, seed: int) -> list[Conversation]:
    """n requests sent at once and without think time (also before idle CPU is measured)."""
    return make_chats(replace(spec, think_s=0.0), n, float("inf"), 1.0, seed)


def requests(convs: list[Conversation]) -> list[tuple[int, int]]:
    """(conversation, turn) of every request, in the order results are written."""
    return [(c.index, t) for c in convs for t in range(len(c.turns))]


def labels(convs: list[Conversation], kind: str) -> list[str]:
    """The class of each request: its turn number (multiturn) or its system prompt."""
    if kind == "multiturn":
        return [f"turn{t + 1}" for _, t in requests(convs)]
    return [f"prefix{c.prefix}" for c in convs for _ in c.turns]


def prompt_lens(conv: Conversation) -> list[int]:
    """Each turn's prompt length when every reply is output_len tokens long."""
    out, n = [], conv.system_len
    for t in conv.turns:
        n += t.user_len
        out.append(n)
        n += t.output_len
    return out


def tokens(plan: Plan, key: str, n: int, vocab: list[int]) -> list[int]:
    # A string seed is hashed with SHA-512: the same on every run, whatever PYTHONHASHSEED is.
    return random.Random(f"{plan.seed}/{plan.run}/{key}").choices(vocab, k=n)


def system_tokens(plan: Plan, conv: Conversation, vocab: list[int]) -> list[int]:
    return tokens(plan, f"system{conv.prefix}", conv.system_len, vocab)


def user_tokens(plan: Plan, conv: Conversation, turn: int, vocab: list[int]) -> list[int]:
    return tokens(plan, f"user{conv.index}.{turn}", conv.turns[turn].user_len, vocab)


def as_items(convs: list[Conversation]) -> list[Item]:
    """One-turn conversations as trace items whose system prompt is a shared prefix."""
    assert all(len(c.turns) == 1 for c in convs), "a timed trace cannot feed replies back"
    return [Item(c.index, f"prefix{c.prefix}", c.system_len + c.turns[0].user_len,
                 c.turns[0].output_len, c.start, prefix=c.prefix, prefix_len=c.system_len)
            for c in convs]


def describe(spec: ChatSpec) -> str:
    system = "-".join(str(x) for x in sorted(set(spec.system_len)))
    user = "-".join(str(x) for x in sorted(set(spec.user_len)))
    if spec.kind == "shared-prefix":
        return (f"shared-prefix: {spec.prefixes} system prompts of {system} tokens, questions "
                f"of {user} tokens, {spec.output_len} out")
    turns = "-".join(str(x) for x in sorted(set(spec.turns)))
    return (f"multiturn: {turns} turns behind a {system}-token system prompt, {user} new user "
            f"tokens and {spec.output_len} out per turn, think time exp(mean {spec.think_s:g} s); "
            f"conversations start at rate / {spec.mean_turns:g}")
