"""Worker-selection policies: small classes over a list of candidate workers (pure logic).

Every policy gets only workers that may take work (ready, right role) and returns one of them.
Ties are broken by worker id so that a choice is reproducible in tests. `cached` maps a worker id
to the prompt tokens its engine holds, from the pool's KV index (None: the index cannot say);
only the kv_aware policies read it.
"""

from __future__ import annotations

import abc
import hashlib
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from pdserve.controller.registry import Worker


Cached = Mapping[str, "int | None"]


class Policy(abc.ABC):
    name = ""
    uses_cache = False  # wants `cached` (the caller then looks the prompt up in the index)

    @abc.abstractmethod
    def choose(self, workers: Sequence[Worker], prompt: Sequence[int] = (),
               cached: Cached | None = None) -> Worker | None:
        """One of `workers` (all of which may take work), or None if there are none."""

    def routed(self, worker: Worker, prompt: Sequence[int]) -> None:
        """Called once the request is sent to `worker` (for policies that learn)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._next = 0

    def choose(self, workers, prompt=(), cached=None):
        if not workers:
            return None
        ordered = sorted(workers, key=lambda w: w.id)
        w = ordered[self._next % len(ordered)]
        self._next += 1
        return w


class LeastLoaded(Policy):
    """Fewest requests (engine report + our own in flight); ties go to the least recently
    chosen worker, so that requests arriving one at a time still spread over the pool."""

    name = "least_loaded"

    def __init__(self):
        self._turn = 0
        self._last: dict[str, int] = {}

    def choose(self, workers, prompt=(), cached=None):
        if not workers:
            return None
        return min(workers, key=self.order)

    def order(self, w: Worker) -> tuple:
        return (w.score(), w.load.kv_usage, self._last.get(w.id, -1), w.id)

    def routed(self, worker, prompt):
        self._turn += 1
        self._last[worker.id] = self._turn
        if len(self._last) > 4 * 1024:  # forget workers long gone
            for wid in sorted(self._last, key=lambda wid: self._last[wid])[:1024]:
                del self._last[wid]


class PowerOfTwo(Policy):
    """Two random candidates, the less loaded wins: near least-loaded without herding."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def choose(self, workers, prompt=(), cached=None):
        if not workers:
            return None
        if len(workers) == 1:
            return workers[0]
        a, b = self.rng.sample(list(workers), 2)
        # A tie goes to the first drawn (random): by id, low ids would take most of the load.
        return min((a, b), key=lambda w: w.score())


class PrefixAware(Policy):
    """Send a prompt to the worker that last prefilled its longest known prefix.

    The controller remembers, per block-aligned prefix hash, which worker prefilled it (an LRU
    of bounded size: an approximation of each engine's prefix cache). The holder wins unless
    it is busier than the least-loaded candidate by more than `balance` requests, so one hot
    prefix cannot pile everything on one worker.
    """

    name = "prefix_aware"

    def __init__(self, block_size: int = 16, balance: float = 4.0, capacity: int = 200_000):
        self.block_size = block_size
        self.balance = balance
        self.capacity = capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def _hashes(self, prompt: Sequence[int]) -> list[bytes]:
        out, h = [], hashlib.blake2b(digest_size=16)
        full = len(prompt) // self.block_size * self.block_size
        for start in range(0, full, self.block_size):
            h.update(bytes(str(list(prompt[start:start + self.block_size])), "ascii"))
            out.append(h.copy().digest())
        return out

    def match(self, prompt: Sequence[int]) -> dict[str, int]:
        """Worker id -> number of leading prompt blocks it is believed to hold."""
        matched: dict[str, int] = {}
        for i, h in enumerate(self._hashes(prompt)):
            owner = self._owner.get(h)
            if owner is None:
                break
            matched[owner] = i + 1
        return matched

    def choose(self, workers, prompt=(), cached=None):
        if not workers:
            return None
        least = min(workers, key=lambda w: (w.score(), w.id))
        matched = self.match(prompt)
        holders = [w for w in workers if matched.get(w.id)]
        if not holders:
            return least
        best = max(holders, key=lambda w: (matched[w.id], -w.score(), w.id))
        if best.score() - least.score() > self.balance:
            return least
        return best

    def routed(self, worker, prompt):
        for h in self._hashes(prompt):
            self._owner[h] = worker.id
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)


class KvAware(PrefixAware):
    """Route on what the engines hold (the pool's KV index), weighed against their load.

    Prefill: the lowest cost, cost = the prompt tokens the worker would compute (those its
    engine lacks) + the work queued on it in tokens (its requests x the mean prompt routed
    here), so a hot prefix spreads once its holder is busier than recomputing elsewhere costs.
    Decode: the worker holding the longest prefix (it then reads only the blocks it lacks, or
    prefills the rest itself), unless it is busier than the least-loaded one by more than
    `balance` requests: a decode worker's load is every stream's step time.
    A worker the index cannot speak for (no events, a gap in them) is judged by PrefixAware's
    estimate (what this controller sent where), so the policy degrades to that one.
    """

    name = "kv_aware"
    uses_cache = True

    def __init__(self, side: str, block_size: int = 16, balance: float = 4.0):
        super().__init__(block_size=block_size, balance=balance)
        self.side = side
        self.mean_prompt = 512.0  # tokens; a moving average of what is routed
        self.ties = LeastLoaded()  # equal costs: least loaded, then least recently chosen

    def held(self, workers: Sequence[Worker], prompt: Sequence[int],
             cached: Cached | None) -> dict[str, int]:
        """Tokens of `prompt` each worker is believed to hold."""
        estimate: dict[str, int] | None = None
        out = {}
        for w in workers:
            c = (cached or {}).get(w.id)
            if c is None:
                if estimate is None:
                    estimate = self.match(prompt)
                c = min(estimate.get(w.id, 0) * self.block_size, max(0, len(prompt) - 1))
            out[w.id] = c
        return out

    def choose(self, workers, prompt=(), cached=None):
        if not workers:
            return None
        held = self.held(workers, prompt, cached)
        rank = {w.id: i for i, w in enumerate(sorted(workers, key=self.ties.order))}
        if self.side == "prefill":
            n = len(prompt)
            return min(workers, key=lambda w: (n - held[w.id] + w.score() * self.mean_prompt,
                                               rank[w.id]))
        least = min(workers, key=lambda w: rank[w.id])
        best = min(workers, key=lambda w: (-held[w.id], rank[w.id]))
        if not held[best.id] or best.score() - least.score() > self.balance:
            return least
        return best

    def routed(self, worker, prompt):
        super().routed(worker, prompt)
        self.ties.routed(worker, prompt)
        self.mean_prompt += 0.05 * (len(prompt) - self.mean_prompt)


POLICIES = {p.name: p for p in (RoundRobin, LeastLoaded, PowerOfTwo, PrefixAware, KvAware)}
PREFILL_POLICIES = sorted(POLICIES)
DECODE_POLICIES = sorted(n for n in POLICIES if n != PrefixAware.name)


def make_policy(name: str, block_size: int = 16, side: str = "prefill") -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}")
    if name == KvAware.name:
        return KvAware(side, block_size=block_size)
    if name == PrefixAware.name:
        return PrefixAware(block_size=block_size)
    simple: dict[str, type[RoundRobin | LeastLoaded | PowerOfTwo]] = {
        p.name: p for p in (RoundRobin, LeastLoaded, PowerOfTwo)}
    return simple[name]()
