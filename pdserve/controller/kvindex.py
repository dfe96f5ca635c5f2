"""Which prefix-cache blocks each worker's engine holds, from vLLM's KV cache events.

Workers relay their engine's KVEventBatch objects as (worker_id, seq, batch); `apply` folds them
in; `match(block_keys(prompt))` gives the leading blocks of a prompt each worker holds.

Keys. Engine block hashes depend on the engine's hash seed and algorithm, so blocks are keyed by
our own chain over token ids: key_0 = H(root, block 0's tokens), key_i = H(key_{i-1}, block i's
tokens), H = hash() of (int, tuple of ints). Ints hash to themselves mod 2**61-1 and tuple
hashing is a fixed xxHash-style mix, so keys do not depend on PYTHONHASHSEED (tested across
processes); 4x cheaper than blake2b. The root mixes in the LoRA name (what vLLM's own hash uses;
adapter ids are per server), else lora_id. A block whose event carries other extra keys
(multimodal ids, cache_salt, prompt-embeds digests) mixes their digest into its key, so it never
matches a plain token prompt. A collision (~2**-61 a pair) only misroutes.

What counts: BlockStored / BlockRemoved of the main pool (medium None or "GPU", KV cache group 0,
local, no secondary tier; offload tiers "CPU" / "STORAGE" are ignored) and AllBlocksCleared. A
BlockStored of another block size, or whose tokens do not cover its hashes (null blocks of
sliding-window groups), is skipped; one whose parent the worker's map lacks is unchained:
counted and skipped. Both are misses, never false hits, and no replay would help them.

Sequence numbers, per worker. In order: applied. Past a gap: held (at most max_pending) and not
applied, since out of order a removal in the gap could be undone or a chain broken; the worker
is stale (never matched) and needs_replay() gives the seq to replay from. When the gap fills the
held batches apply in order, so indexes fed one stream, live or replayed, agree exactly. A gap
open for stale_timeout (or too many held) gives up: the worker's entries go and it resumes from
its oldest held batch. At or below the last applied seq: a replay duplicate while a gap is open
or within stale_timeout after it closed; otherwise the engine restarted (its publisher counts
from 0 again) and the entries go. reset() says so explicitly; drop() forgets a worker;
correct() unmatches what an engine said it lacked, so a lost removal misroutes once.

Memory: entries are capped per worker at its capacity (the engine's block count) and in total at
max_blocks; over a cap, a worker's oldest-stored 1/16 go at once (a re-store refreshes; the
engine evicts LRU; one pass keeps eviction amortised O(1) on an insertion-ordered dict).

Measured by `.venv/bin/python -m pdserve.bench.kvindex_bench` (Python 3.11, 2 shared cores), 1M
blocks of 2000-token prompts (block 16), with 8 / 64 workers: 148 / 171 MB (tracemalloc),
applied at 1.1 / 1.3 M blocks/s. block_keys of 2000 tokens: 33 us. match() of a 125-block
prompt held by every worker to staggered depths (the worst walk): 10 / 24 us (12 us over 8 named
workers of the 64); a first-block miss: 0.3 us.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import count, islice
from typing import Any, NamedTuple, Protocol

ROOT = 0x7064736572766531  # b"pdserve1": the parent of every prompt's first block


class EventBatch(Protocol):
    """vLLM's KVEventBatch, or anything with its events (dispatched on their class names)."""

    @property
    def events(self) -> Sequence[Any]: ...


class WorkerView(NamedTuple):
    blocks: int  # entries held, including ones correct() unmatched (still chain links)
    capacity: int
    last_seq: int | None
    stale: bool
    replay_from: int | None
    gaps: int
    resets: int  # engine restarts and gap give-ups: entries dropped
    unchained: int  # BlockStored events whose parent was unknown
    skipped: int  # BlockStored events of another block size or with null blocks


def _digest(value: object) -> int:
    # hash() of a str varies per process; repr of str/bytes/int tuples does not.
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "big")


def root_key(lora: str | int | None = None) -> int:
    return ROOT if lora is None else hash((ROOT, _digest(lora)))


def _chain(prev: int, tokens: Sequence[int], block_size: int,
           extras: Sequence[Any] | None = None) -> list[int]:
    keys = []
    for i, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        block = tuple(tokens[start:start + block_size])
        extra = extras[i] if extras else None
        prev = hash((prev, block, _digest(extra))) if extra else hash((prev, block))
        keys.append(prev)
    return keys


def block_keys(token_ids: Sequence[int], block_size: int,
               lora: str | int | None = None) -> list[int]:
    """The keys of a prompt's full blocks, as match() takes them."""
    return _chain(root_key(lora), token_ids, block_size)


def _main_pool(ev: Any) -> bool:
    return ((ev.medium or "GPU").upper() == "GPU" and getattr(ev, "group_idx", None) in (None, 0)
            and getattr(ev, "locality", None) in (None, "LOCAL")
            and getattr(ev, "ownership", None) is None)


@dataclass(eq=False)
class _Worker:
    bit: int
    capacity: int
    next_seq: int | None
    blocks: dict[Any, int] = field(default_factory=dict)  # engine hash -> key, oldest first
    pending: dict[int, EventBatch] = field(default_factory=dict)  # held past a gap, by seq
    gap_since: float | None = None
    dups_until: float = float("-inf")
    gaps: int = 0
    resets: int = 0
    unchained: int = 0
    skipped: int = 0


class KVIndex:
    def __init__(self, block_size: int, *, max_blocks: int = 2_000_000,
                 stale_timeout: float = 10.0, max_pending: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self._max_blocks = max_blocks
        self._stale_timeout = stale_timeout
        self._max_pending = max_pending
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._by_slot: dict[int, str] = {}
        self._holders: dict[int, int] = {}  # key -> bitmask of the slots of workers holding it
        self._usable = 0  # bits of workers that are not stale
        self._total = 0

    def __len__(self) -> int:
        return self._total

    def add_worker(self, worker_id: str, capacity: int, first_seq: int | None = 0) -> None:
        """first_seq: the seq its stream starts at (None: whatever comes first, no replay)."""
        self.drop(worker_id)
        slot = next(i for i in count() if i not in self._by_slot)
        self._by_slot[slot] = worker_id
        self._workers[worker_id] = _Worker(1 << slot, capacity, first_seq)
        self._usable |= 1 << slot

    def drop(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._clear(w)
            self._usable &= ~w.bit
            del self._by_slot[w.bit.bit_length() - 1]

    def reset(self, worker_id: str) -> None:
        """Its engine restarted: what it held is gone and its seqs start again at 0."""
        if (w := self._workers.get(worker_id)) is not None:
            self._restart(w)

    def exact(self, worker_id: str) -> bool:
        """Whether match() speaks for this worker now (a member, not stale)."""
        w = self._workers.get(worker_id)
        return w is not None and bool(self._usable & w.bit)

    def needs_replay(self, worker_id: str) -> int | None:
        w = self._workers.get(worker_id)
        return w.next_seq if w is not None and w.pending else None

    def apply(self, worker_id: str, seq: int, batch: EventBatch) -> None:
        if (w := self._workers.get(worker_id)) is None:
            return  # not (or no longer) a member: nothing to route to
        now = self._clock()
        self._check_gap(w, now)
        if w.next_seq is None:
            w.next_seq = seq
        if seq < w.next_seq:
            if seq == w.next_seq - 1 or w.pending or now < w.dups_until:
                return  # a replay overlapping what came live
            self._restart(w)
        if seq > w.next_seq:
            if not w.pending:
                w.gap_since, w.gaps = now, w.gaps + 1
                self._usable &= ~w.bit
            w.pending.setdefault(seq, batch)
            if len(w.pending) > self._max_pending:
                self._give_up(w, now)
            return
        self._apply(w, batch)
        w.next_seq += 1
        self._drain(w, now)

    def expire(self) -> list[str]:
        """Give up the gaps open for stale_timeout; the ids of those workers."""
        now = self._clock()
        return [wid for wid, w in list(self._workers.items()) if self._check_gap(w, now)]

    def correct(self, worker_id: str, keys: Sequence[int], cached_blocks: int) -> int:
        """The engine had only cached_blocks of keys: unmatch the rest; how many were held.

        vLLM never reports a prompt's last token as cached: pass the keys of prompt[:-1].
        """
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        held = [k for k in keys[cached_blocks:] if self._holders.get(k, 0) & w.bit]
        for key in held:
            self._unhold(w.bit, key)
        return len(held)

    def match(self, keys: Sequence[int], workers: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of keys held by each non-stale worker; workers holding none omitted."""
        alive = self._usable
        if workers is not None:
            alive &= sum(self._workers[wid].bit for wid in workers if wid in self._workers)
        out: dict[str, int] = {}
        if not alive:
            return out
        holders = self._holders
        for i, key in enumerate(keys):
            held = alive & holders.get(key, 0)
            if held != alive:
                if i:
                    self._name(alive ^ held, i, out)
                alive = held
                if not alive:
                    return out
        if keys:
            self._name(alive, len(keys), out)
        return out

    def snapshot(self) -> dict[str, WorkerView]:
        return {
            wid: WorkerView(len(w.blocks), w.capacity,
                            w.next_seq - 1 if w.next_seq else None, bool(w.pending),
                            w.next_seq if w.pending else None, w.gaps, w.resets, w.unchained,
                            w.skipped)
            for wid, w in self._workers.items()}

    def _name(self, mask: int, n: int, out: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            out[self._by_slot[low.bit_length() - 1]] = n
            mask ^= low

    def _drain(self, w: _Worker, now: float) -> None:
        assert w.next_seq is not None
        while w.next_seq in w.pending:
            self._apply(w, w.pending.pop(w.next_seq))
            w.next_seq += 1
        if w.gap_since is not None and not w.pending:
            w.gap_since, w.dups_until = None, now + self._stale_timeout
            self._usable |= w.bit

    def _check_gap(self, w: _Worker, now: float) -> bool:
        if w.gap_since is None or now - w.gap_since < self._stale_timeout:
            return False
        self._give_up(w, now)
        return True

    def _give_up(self, w: _Worker, now: float) -> None:
        # The gap may have removed anything: forget it all, resume from what was held.
        self._clear(w)
        w.resets += 1
        w.next_seq, w.gap_since = min(w.pending), now
        self._drain(w, now)

    def _restart(self, w: _Worker) -> None:
        self._clear(w)
        w.resets += 1
        w.next_seq, w.pending, w.gap_since, w.dups_until = 0, {}, None, float("-inf")
        self._usable |= w.bit

    def _apply(self, w: _Worker, batch: EventBatch) -> None:
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                self._store(w, ev)
            elif kind == "BlockRemoved" and _main_pool(ev):
                for h in ev.block_hashes:
                    if (key := w.blocks.pop(h, None)) is not None:
                        self._unhold(w.bit, key)
                        self._total -= 1
            elif kind == "AllBlocksCleared":
                self._clear(w)
        if len(w.blocks) > w.capacity:
            self._evict(w, len(w.blocks) - w.capacity + w.capacity // 16)
        while self._total > self._max_blocks:
            big = max(self._workers.values(), key=lambda x: len(x.blocks))
            self._evict(big, max(self._total - self._max_blocks, len(big.blocks) // 16))

    def _store(self, w: _Worker, ev: Any) -> None:
        hashes, size, tokens = ev.block_hashes, ev.block_size, ev.token_ids
        if not _main_pool(ev):
            return
        if size != self.block_size or len(tokens) != size * len(hashes):
            w.skipped += 1
            return
        lora = getattr(ev, "lora_name", None)
        prev = (root_key(lora if lora is not None else ev.lora_id)
                if ev.parent_block_hash is None else w.blocks.get(ev.parent_block_hash))
        if prev is None:
            w.unchained += 1
            return
        extras = getattr(ev, "extra_keys", None)
        if extras and lora is not None:  # the name leads each block's extras; it is in the root
            extras = [e[1:] if e and e[0] == lora else e for e in extras]
        holders, bit = self._holders, w.bit
        for h, key in zip(hashes, _chain(prev, tokens, size, extras)):
            old = w.blocks.pop(h, None)
            w.blocks[h] = key  # (re)inserted last: a re-store counts as recent use
            if old is None:
                self._total += 1
            elif old != key:
                self._unhold(bit, old)
            holders[key] = holders.get(key, 0) | bit

    def _unhold(self, bit: int, key: int) -> None:
        mask = self._holders.get(key, 0) & ~bit
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    def _evict(self, w: _Worker, n: int) -> None:
        for h in list(islice(w.blocks, max(1, n))):
            self._unhold(w.bit, w.blocks.pop(h))
            self._total -= 1

    def _clear(self, w: _Worker) -> None:
        for key in w.blocks.values():
            self._unhold(w.bit, key)
        self._total -= len(w.blocks)
        w.blocks = {}
