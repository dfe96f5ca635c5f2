"""Cache-aware P/D over the pool's KV index (fake engines publish vLLM-shaped KV events):
routing on both sides, skipped handoffs, receipts, and a cut event stream."""

from __future__ import annotations

import asyncio

from fakepool import fast_settings, final_tokens, greedy, wait_until

from pdserve import fake
from pdserve.controller.kvindex import block_keys
from pdserve.controller.receipts import header, open_receipt

BS = 16  # the fake engines' block size
SYSTEM = [50 + (7 * i) % 400 for i in range(8 * BS)]  # a shared 128-token system prompt


def kv_settings(**kw):
    return fast_settings(prefill_policy="kv_aware", decode_policy="kv_aware", **kw)


def turn(history: list[int], user: int, n: int = 2 * BS) -> list[int]:
    """`history` and n new tokens, different for each `user` (ids within the tiny vocabulary)."""
    return history + [50 + (user * 13 + 3 * i) % 400 for i in range(n)]


async def converse(c, turns: int, reply: int = 8, first: list[int] | None = None):
    """A conversation: each turn's prompt is the last one + its reply + new user tokens."""
    prompt, routes = turn(first or SYSTEM, 5000), []
    for t in range(turns):
        receipt = open_receipt()
        outs = await c.run(prompt, greedy(reply))
        tokens = final_tokens(outs)
        assert tokens == fake.reference(prompt, greedy(reply)).token_ids
        routes.append(receipt[0])
        prompt = turn(prompt + tokens, 6000 + 100 * t)
    return routes


def held(c, worker_id: str, prompt: list[int]) -> int | None:
    w = c.pool.registry.workers[worker_id]
    return c.pool.cached_tokens(block_keys(prompt, BS), len(prompt), [w])[worker_id]


async def test_the_index_learns_what_each_engine_holds_from_its_events(make_cluster):
    c = await make_cluster(settings=kv_settings())
    p, = await c.add("prefill")
    d, = await c.add("decode")
    prompt = turn(SYSTEM, 5000)
    await c.run(prompt, greedy(4))
    full = min(len(prompt) // BS * BS, len(prompt) - 1)
    await wait_until(lambda: held(c, p.worker_id, prompt) == full, what="prefill's blocks")
    await wait_until(lambda: held(c, d.worker_id, prompt) == full, what="decode's blocks")
    assert held(c, p.worker_id, [7] * 64) == 0
    await c.assert_clean()


async def test_follow_up_turns_go_to_the_decode_worker_that_holds_the_conversation(
        make_cluster):
    c = await make_cluster(settings=kv_settings())
    await c.add("prefill")
    d1, d2 = await c.add("decode", 2)
    routes = await converse(c, 3)
    first = routes[0].decode
    assert [r.decode for r in routes] == [first] * 3
    assert all(r.path == "disaggregated" for r in routes)
    # Turns 2 and 3: the decode engine had the conversation so far and read only the rest.
    for r in routes[1:]:
        assert r.decode_cached and r.decode_hit == r.decode_cached
        assert r.kv_read_tokens is not None and r.kv_read_tokens < 4 * BS
        assert r.kv_bytes == -(-r.kv_read_tokens // BS) * fake.KV_BYTES_PER_TOKEN * BS
    assert routes[0].kv_read_tokens >= len(SYSTEM)
    other = d2 if first == d1.worker_id else d1
    assert other.engine.served == []
    await c.assert_clean()


async def test_a_small_uncached_remainder_is_prefilled_by_the_decode_worker(make_cluster):
    c = await make_cluster(settings=kv_settings(skip_handoff_below=4 * BS))
    p, = await c.add("prefill")
    await c.add("decode", 2)
    routes = await converse(c, 3)
    assert routes[0].path == "disaggregated"  # nothing cached yet, 160 tokens to compute
    assert [(r.path, r.reason) for r in routes[1:]] == [("local", "cached")] * 2
    assert len({r.decode for r in routes}) == 1
    assert len(p.engine.served) == 1
    assert c.controller.metrics.routes.labels("local", "cached")._value.get() == 2
    await c.assert_clean()


async def test_prefill_prefers_the_holder_until_its_queue_costs_more(make_cluster):
    c = await make_cluster(settings=kv_settings())
    p1, p2 = await c.add("prefill", 2)
    await c.add("decode")
    prompt = turn(SYSTEM, 5000, 4 * BS)
    await c.run(prompt, greedy(2))
    holder = next(w for w in (p1, p2) if w.engine.served)
    await wait_until(lambda: held(c, holder.worker_id, prompt))
    again = turn(SYSTEM, 7000, 4 * BS)  # shares the system prompt only
    await c.run(again, greedy(2))
    assert len(holder.engine.served) == 2
    # Busy enough that its queue outweighs the 128 cached tokens: the other one computes it.
    c.pool.registry.workers[holder.worker_id].inflight = 3
    c.controller.prefill_policy.mean_prompt = 200.0
    await c.run(turn(SYSTEM, 8000, 4 * BS), greedy(2))
    assert len(holder.engine.served) == 2
    c.pool.registry.workers[holder.worker_id].inflight = 0
    await c.assert_clean()


async def test_the_receipt_names_the_route(make_cluster):
    c = await make_cluster(settings=kv_settings())
    p, = await c.add("prefill")
    d, = await c.add("decode")
    routes = await converse(c, 2)
    text = header(routes[1:])
    assert text.startswith("disaggregated prefill=" + p.worker_id)
    assert f"decode={d.worker_id} cached={routes[1].decode_cached}" in text
    assert f"kv_bytes={routes[1].kv_bytes}" in text


async def test_a_cut_event_stream_falls_back_then_recovers_by_replay(make_cluster):
    c = await make_cluster(settings=kv_settings())
    await c.add("prefill")
    d, = await c.add("decode")
    prompt = turn(SYSTEM, 5000)
    d.engine.cache.drop_next = 1  # the batch of this request's blocks never reaches anyone
    await c.run(prompt, greedy(4))
    await c.run(turn(SYSTEM, 9000), greedy(4))  # the next batch shows the gap
    await wait_until(lambda: held(c, d.worker_id, prompt) is None or c.pool.kv.needs_replay(
        d.worker_id) is None, what="the gap to be seen")
    # Meanwhile nothing fails: routing treats the worker as unknown.
    outs = await c.run(turn(SYSTEM, 9500), greedy(4))
    assert final_tokens(outs) == fake.reference(turn(SYSTEM, 9500), greedy(4)).token_ids
    # The controller asked for a replay; the worker's engine kept the batch: exact again.
    await wait_until(lambda: held(c, d.worker_id, prompt) == len(prompt) - 1, 10,
                     "the replay to fill the gap")
    assert d.engine.cache.dropped == 1
    await c.assert_clean()


async def test_a_restarted_worker_starts_with_nothing_in_the_index(make_cluster):
    c = await make_cluster(settings=kv_settings())
    await c.add("prefill")
    d, = await c.add("decode", worker_id="decode-x")
    prompt = turn(SYSTEM, 5000)
    await c.run(prompt, greedy(4))
    await wait_until(lambda: bool(held(c, "decode-x", prompt)))
    shown = {w["id"]: w["kv_index"] for w in c.pool.snapshot()}  # as /pd/workers shows it
    assert shown["decode-x"]["blocks"] > 0 and shown["decode-x"]["resets"] == 0
    await c.kill("decode-x")
    c.workers.pop("decode-x")
    before = c.pool.registry.workers["decode-x"]
    c.start("decode", worker_id="decode-x")  # a new engine under the same id
    await wait_until(lambda: c.pool.registry.workers["decode-x"] is not before,
                     what="the new engine to register")
    assert held(c, "decode-x", prompt) == 0
    shown = {w["id"]: w["kv_index"] for w in c.pool.snapshot()}
    assert shown["decode-x"]["blocks"] == 0
    await c.assert_clean()


async def test_two_controllers_reach_the_same_view(make_cluster):
    a = await make_cluster(settings=kv_settings())
    b = await make_cluster(settings=kv_settings())
    p, = await a.add("prefill", controllers=[a.address, b.address])
    d1, d2 = await a.add("decode", 2, controllers=[a.address, b.address])
    await wait_until(lambda: all(b.is_ready(w.worker_id) for w in (p, d1, d2)))
    b.workers.update(a.workers)
    prompts = [turn(SYSTEM, 5000 + 100 * i) for i in range(4)]
    await asyncio.gather(*(a.run(pr, greedy(3)) for pr in prompts[:2]),
                         *(b.run(pr, greedy(3)) for pr in prompts[2:]))

    def views(c):
        return {(w, i): held(c, w, pr) for w in (p.worker_id, d1.worker_id, d2.worker_id)
                for i, pr in enumerate(prompts)}

    await wait_until(lambda: views(a) == views(b), what="the two indexes to agree")
    assert any(views(a).values())
    await a.assert_clean()
