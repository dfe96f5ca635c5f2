"""The controller's prefix-cache index (controller/kvindex.py) fed vLLM's own event classes."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import msgspec
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from pdserve.controller.kvindex import KVIndex, block_keys

B = 16
ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def stored(hashes, tokens, parent=None, **kw) -> BlockStored:
    kw.setdefault("medium", "GPU")
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=list(tokens), block_size=kw.pop("block_size", B),
                       lora_id=kw.pop("lora_id", None), lora_name=kw.pop("lora_name", None), **kw)


def batch(*events) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


def toks(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * B))


class Engine:
    """A prefix cache that emits events the way vLLM's BlockPool does: per step, LRU evictions
    as BlockRemoved, then one BlockStored for the newly cached blocks whose parent is the last
    hit; block hashes chained over a per-engine seed, as vLLM's are."""

    def __init__(self, seed: bytes, num_blocks: int = 1000):
        self.seed, self.cap = seed, num_blocks
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.seq = 0

    def hashes(self, tokens: list[int]) -> list[int]:
        out, parent = [], self.seed
        for i in range(len(tokens) // B):
            parent = hashlib.sha256(parent + repr(tokens[i * B:(i + 1) * B]).encode()).digest()
            out.append(int.from_bytes(parent[:8], "big"))
        return out

    def cached(self, tokens: list[int]) -> int:
        hs = self.hashes(tokens)
        return next((i for i, h in enumerate(hs) if h not in self.cache), len(hs))

    def run(self, tokens: list[int]) -> tuple[int, KVEventBatch]:
        hs = self.hashes(tokens)
        hit = 0
        while hit < len(hs) and hs[hit] in self.cache:
            self.cache.move_to_end(hs[hit])
            hit += 1
        events: list = []
        new = hs[hit:]
        while len(self.cache) + len(new) > self.cap:
            events.append(BlockRemoved(block_hashes=[self.cache.popitem(last=False)[0]],
                                       medium="GPU"))
        self.cache.update(dict.fromkeys(new))
        if new:
            events.append(stored(new, tokens[hit * B:len(hs) * B], hs[hit - 1] if hit else None))
        return self.step(events)

    def clear(self) -> tuple[int, KVEventBatch]:
        self.cache.clear()
        return self.step([AllBlocksCleared()])

    def step(self, events: list) -> tuple[int, KVEventBatch]:
        self.seq += 1
        return self.seq - 1, batch(*events)


def index(clock: Clock | None = None, **kw) -> KVIndex:
    return KVIndex(B, clock=clock or Clock(), **kw)


def test_block_keys_cover_full_blocks_chained_and_per_adapter():
    keys = block_keys(list(range(5 * B + 3)), B)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert block_keys(list(range(3 * B)), B) == keys[:3]  # a prefix's keys prefix the prompt's
    assert block_keys(list(range(B, 2 * B)), B)[0] != keys[1]  # same tokens, other parent
    assert block_keys(list(range(3 * B)), B, lora="a") != keys[:3]
    assert block_keys(list(range(3 * B)), B, lora="a") != block_keys(list(range(3 * B)), B, "b")


def test_keys_do_not_depend_on_pythonhashseed():
    code = ("from pdserve.controller.kvindex import block_keys, _chain, root_key;"
            "print(block_keys(list(range(100)), 16, lora='adapter'),"
            " _chain(root_key(), list(range(32)), 16, [('img', 0), ('salt',)]))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, cwd=ROOT).stdout
            for seed in ("0", "1", "4242")}
    assert len(outs) == 1 and str(block_keys(list(range(100)), 16, lora="adapter")) in outs.pop()


def test_one_stored_event_covering_several_blocks_and_a_chained_child():
    kv = index()
    kv.add_worker("w", 100)
    kv.apply("w", 0, batch(stored([11, 12, 13], toks(3))))
    kv.apply("w", 1, batch(stored([14, 15], toks(5)[3 * B:], parent=13)))
    assert kv.match(block_keys(toks(5), B)) == {"w": 5}
    assert kv.match(block_keys(toks(4) + toks(1, 999), B)) == {"w": 4}
    assert kv.match(block_keys(toks(5, 1), B)) == {}
    assert len(kv) == 5


def test_engines_with_different_hash_seeds_give_the_same_keys():
    a, b = Engine(b"seed-a"), Engine(b"seed-b")
    prompt = toks(6)
    assert set(a.hashes(prompt)).isdisjoint(b.hashes(prompt))
    kv = index()
    for wid, engine in (("a", a), ("b", b)):
        kv.add_worker(wid, 100)
        kv.apply(wid, *engine.run(prompt))
    assert kv.match(block_keys(prompt, B)) == {"a": 6, "b": 6}
    assert kv.match(block_keys(prompt[:3 * B] + toks(3, 7777), B)) == {"a": 3, "b": 3}


def test_removed_blocks_shorten_matches_and_all_cleared_empties_the_worker():
    kv = index()
    kv.add_worker("w", 100)
    kv.apply("w", 0, batch(stored([1, 2, 3, 4], toks(4))))
    kv.apply("w", 1, batch(BlockRemoved(block_hashes=[3], medium="GPU")))
    assert kv.match(block_keys(toks(4), B)) == {"w": 2}
    kv.apply("w", 2, batch(BlockRemoved(block_hashes=[1], medium="CPU")))  # an offload tier
    assert kv.match(block_keys(toks(4), B)) == {"w": 2}
    kv.apply("w", 3, batch(AllBlocksCleared()))
    assert kv.match(block_keys(toks(4), B)) == {} and len(kv) == 0


def test_events_outside_the_main_pool_or_unchainable_are_not_indexed():
    kv = index()
    kv.add_worker("w", 100)
    kv.apply("w", 0, batch(stored([1, 2], toks(2), medium="CPU"),
                           stored([3], toks(1), group_idx=1),
                           stored([4], toks(1), locality="REMOTE"),
                           stored([5], toks(1, 50), block_size=8),  # another block size
                           stored([6], toks(2, 90)),  # null blocks left out of the hashes
                           stored([7, 8], toks(2)[B:] + toks(1, 5), parent=999)))  # unknown parent
    assert len(kv) == 0 and kv.match(block_keys(toks(2), B)) == {}
    view = kv.snapshot()["w"]
    assert (view.unchained, view.skipped, view.stale) == (1, 2, False)


def test_lora_name_and_extra_keys_keep_blocks_apart():
    kv = index()
    kv.add_worker("w", 100)
    kv.apply("w", 0, batch(
        stored([1, 2], toks(2), lora_id=7, lora_name="ad", extra_keys=[("ad",), ("ad",)]),
        stored([3], toks(1, 500), extra_keys=[(("img-hash", 0),)])))
    assert kv.match(block_keys(toks(2), B, lora="ad")) == {"w": 2}
    assert kv.match(block_keys(toks(2), B)) == {}
    assert kv.match(block_keys(toks(1, 500), B)) == {}  # an image's placeholders are not text


def test_recorded_stream_decoded_from_publisher_frames():
    # Frames as ZmqEventPublisher sends them: (topic, 8-byte big-endian seq, msgpack payload).
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(type=KVEventBatch)
    system, q1, q2 = toks(4, 1000), toks(1, 5000), toks(1, 6000)
    h = [0x1F3A5C0E2B7D9A41, 0xEB2E5D0C3A1F4E72, 0x0C5E9A7B3D2F1E60, 0x7A1B2C3D4E5F6071,
         0x2222333344445555, 0x3333444455556666]
    recorded = [
        batch(stored(h[:4], system)),
        batch(stored(h[4:5], q1, parent=h[3])),
        batch(stored(h[5:6], q2, parent=h[3]), BlockRemoved(block_hashes=[h[4]], medium="GPU")),
    ]
    frames = [(b"kv", seq.to_bytes(8, "big"), enc.encode(b)) for seq, b in enumerate(recorded)]
    kv = index()
    kv.add_worker("w", 100)
    for _topic, seq, payload in frames:
        kv.apply("w", int.from_bytes(seq, "big"), dec.decode(payload))
    assert kv.match(block_keys(system + q2, B)) == {"w": 5}
    assert kv.match(block_keys(system + q1, B)) == {"w": 4}


def test_out_of_order_batches_wait_for_the_gap_and_apply_in_order():
    kv = index()
    kv.add_worker("w", 100)
    keys = block_keys(toks(2), B)
    kv.apply("w", 0, batch(stored([1], toks(1))))
    kv.apply("w", 2, batch(BlockRemoved(block_hashes=[2], medium="GPU")))  # arrives first
    assert kv.needs_replay("w") == 1 and kv.snapshot()["w"].stale
    assert kv.match(keys) == {}  # stale: left to fallback routing
    kv.apply("w", 1, batch(stored([2], toks(2)[B:], parent=1)))
    assert kv.needs_replay("w") is None and not kv.snapshot()["w"].stale
    assert kv.match(keys) == {"w": 1}  # the removal came after the store: no false hit


def test_a_gap_is_filled_by_a_replay_overlapping_the_live_stream():
    engine, kv = Engine(b"e"), index()
    kv.add_worker("w", 1000)
    steps = [engine.run(toks(3, 100 * i)) for i in range(8)]
    for seq, b in steps[:3] + steps[5:7]:  # 3 and 4 lost on the way
        kv.apply("w", seq, b)
    assert kv.needs_replay("w") == 3 and kv.match(block_keys(toks(3), B)) == {}
    for seq, b in steps[3:]:  # the replay from 3, then the live 7
        kv.apply("w", seq, b)
    view = kv.snapshot()["w"]
    assert (view.last_seq, view.stale, view.gaps, view.resets) == (7, False, 1, 0)
    assert all(kv.match(block_keys(toks(3, 100 * i), B)) == {"w": 3} for i in range(8))


def test_a_gap_not_filled_in_time_drops_the_workers_entries():
    clock = Clock()
    kv = index(clock, stale_timeout=5.0)
    kv.add_worker("w", 100)
    kv.apply("w", 0, batch(stored([1, 2], toks(2))))
    kv.apply("w", 2, batch(stored([3], toks(1, 300))))
    clock.t += 4.9
    assert kv.expire() == [] and kv.snapshot()["w"].stale
    clock.t += 0.1
    assert kv.expire() == ["w"]
    assert kv.match(block_keys(toks(2), B)) == {}  # may have been removed in the gap
    assert kv.match(block_keys(toks(1, 300), B)) == {"w": 1}  # resumed from the held batch
    view = kv.snapshot()["w"]
    assert (view.stale, view.last_seq, view.resets, view.blocks) == (False, 2, 1, 1)
    kv.apply("w", 1, batch(stored([9], toks(1, 900))))  # the replay, too late: ignored
    kv.apply("w", 3, batch(stored([4], toks(1, 400))))
    assert kv.match(block_keys(toks(1, 400), B)) == {"w": 1} and len(kv) == 2


def test_too_many_held_batches_give_up_at_once():
    kv = index(max_pending=3)
    kv.add_worker("w", 100)
    kv.apply("w", 0, batch(stored([1], toks(1))))
    for seq in range(2, 6):
        kv.apply("w", seq, batch(stored([seq * 10], toks(1, seq * 100))))
    view = kv.snapshot()["w"]
    assert (view.stale, view.last_seq, view.resets, view.blocks) == (False, 5, 1, 4)
    assert kv.match(block_keys(toks(1), B)) == {}


def test_a_late_joiner_replays_from_zero():
    kv = index()
    kv.add_worker("w", 100)  # expects seq 0
    engine = Engine(b"e")
    steps = [engine.run(toks(2, 100 * i)) for i in range(4)]
    kv.apply("w", *steps[3])
    assert kv.needs_replay("w") == 0
    for seq, b in steps:
        kv.apply("w", seq, b)
    assert kv.snapshot()["w"].blocks == 8 and kv.needs_replay("w") is None


def test_a_sequence_that_starts_again_means_the_engine_restarted():
    kv = index(Clock(), stale_timeout=5.0)
    kv.add_worker("w", 100)
    old, new, third = Engine(b"old"), Engine(b"new"), Engine(b"third")
    for i in range(3):
        kv.apply("w", *old.run(toks(2, 100 * i)))
    kv.apply("w", *new.run(toks(1, 900)))  # seq 0 again
    assert kv.match(block_keys(toks(2), B)) == {}
    assert kv.match(block_keys(toks(1, 900), B)) == {"w": 1}
    view = kv.snapshot()["w"]
    assert (view.last_seq, view.resets, view.blocks) == (0, 1, 1)
    for i in range(3):
        kv.apply("w", *new.run(toks(1, 1000 + 100 * i)))
    third.run(toks(1, 5000))  # its seq 0 is lost: the restart shows as seq 1 after seq 3
    kv.apply("w", *third.run(toks(1, 5100)))
    assert len(kv) == 0 and kv.needs_replay("w") == 0 and kv.snapshot()["w"].resets == 2
    kv.reset("w")  # said by the worker, which saw its engine restart
    view = kv.snapshot()["w"]
    assert (view.last_seq, view.stale, view.resets) == (None, False, 3)
    assert kv.needs_replay("w") is None


def test_a_replay_duplicate_after_the_gap_closed_is_not_a_restart():
    clock = Clock()
    kv = index(clock, stale_timeout=5.0)
    kv.add_worker("w", 100)
    engine = Engine(b"e")
    steps = [engine.run(toks(1, 100 * i)) for i in range(4)]
    for seq, b in (steps[0], steps[2], steps[3], steps[1]):
        kv.apply("w", seq, b)
    clock.t += 1.0
    kv.apply("w", *steps[2])  # the replay's copy, after the live one
    assert kv.snapshot()["w"].resets == 0 and len(kv) == 4
    clock.t += 5.0
    kv.apply("w", *steps[0])  # long after any replay: the engine started again
    assert kv.snapshot()["w"].resets == 1 and len(kv) == 1


def test_a_dead_worker_is_dropped_and_its_slot_reused_clean():
    kv = index()
    kv.add_worker("a", 100)
    kv.add_worker("b", 100)
    for wid in ("a", "b"):
        kv.apply(wid, 0, batch(stored([1, 2], toks(2))))
    kv.drop("a")
    assert kv.match(block_keys(toks(2), B)) == {"b": 2} and len(kv) == 2
    kv.add_worker("c", 100)
    assert kv.match(block_keys(toks(2), B)) == {"b": 2}
    kv.apply("a", 1, batch(stored([3], toks(1, 50))))  # a late event of the dead: ignored
    assert set(kv.snapshot()) == {"b", "c"}


def test_correct_unmatches_what_the_engine_did_not_have():
    kv = index()
    kv.add_worker("w", 100)
    kv.apply("w", 0, batch(stored([1, 2, 3, 4, 5], toks(5))))
    keys = block_keys(toks(5), B)
    assert kv.correct("w", keys, 2) == 3
    assert kv.match(keys) == {"w": 2}
    assert kv.correct("w", keys, 2) == 0 and kv.correct("gone", keys, 0) == 0
    kv.apply("w", 1, batch(stored([3, 4], toks(4)[2 * B:], parent=2)))  # recomputed
    assert kv.match(keys) == {"w": 4}


def test_entries_are_capped_per_worker_and_in_total():
    kv = index(max_blocks=50)
    kv.add_worker("w", 32)
    seq = iter(range(100))
    for i in range(32):
        kv.apply("w", next(seq), batch(stored([i + 1], toks(1, 100 * i))))
    assert len(kv) == 32
    kv.apply("w", next(seq), batch(stored([1], toks(1, 0))))  # a re-store refreshes the oldest
    kv.apply("w", next(seq), batch(stored([100], toks(1, 10_000))))  # over: 3 oldest go
    assert len(kv) == 30

    def held(start: int) -> bool:
        return kv.match(block_keys(toks(1, start), B)) == {"w": 1}

    assert held(0) and not held(100) and not held(300) and held(400)
    kv.add_worker("v", 40)
    kv.apply("v", 0, batch(stored(range(200, 240), toks(40, 50_000))))
    assert len(kv) == 50 and kv.snapshot()["v"].blocks == 20  # the biggest worker trimmed


def test_match_names_only_workers_with_blocks_and_honours_a_pool():
    kv = index()
    for i, wid in enumerate(["a", "b", "c"]):
        kv.add_worker(wid, 100)
        kv.apply(wid, 0, batch(stored(range(i + 1), toks(i + 1))))
    kv.add_worker("empty", 100)
    keys = block_keys(toks(3), B)
    assert kv.match(keys) == {"a": 1, "b": 2, "c": 3}
    assert kv.match(keys, ["b", "c", "unknown"]) == {"b": 2, "c": 3}
    assert kv.match(keys, []) == {} and kv.match([]) == {}


def test_two_indexes_fed_one_stream_agree():
    rng = random.Random(7)
    engines = {f"w{i}": Engine(f"seed{i}".encode(), num_blocks=40) for i in range(3)}
    systems = [toks(rng.randint(1, 6), 10_000 * s) for s in range(4)]
    prompts = [rng.choice(systems) + toks(rng.randint(0, 4), rng.randrange(10**6))
               for _ in range(120)]
    streams: dict[str, list] = {wid: [] for wid in engines}
    for i, p in enumerate(prompts):
        wid = rng.choice(sorted(engines))
        streams[wid].append(engines[wid].clear() if i == 60 else engines[wid].run(p))
    live, late = index(), index()
    for kv in (live, late):
        for wid in engines:
            kv.add_worker(wid, 40)
    for wid, stream in streams.items():
        for seq, b in stream:
            live.apply(wid, seq, b)
        tail = stream[len(stream) // 2:]  # the late one sees the second half live, shuffled,
        rng.shuffle(tail)
        for seq, b in tail:
            late.apply(wid, seq, b)
        assert late.needs_replay(wid) == 0
        for seq, b in stream:  # then a replay from 0 that overlaps it
            late.apply(wid, seq, b)
    assert late.snapshot() == live.snapshot() | {
        wid: live.snapshot()[wid]._replace(gaps=1) for wid in engines}
    for p in prompts + systems:
        truth = {wid: n for wid, e in engines.items() if (n := e.cached(p))}
        assert late.match(block_keys(p, B)) == live.match(block_keys(p, B)) == truth
    assert any(live.match(block_keys(p, B)) for p in prompts)
