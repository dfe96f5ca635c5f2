"""Aborts at every point of a request free everything: no request and no KV block stays anywhere."""

from __future__ import annotations

import asyncio
import random

import pytest
from fakepool import cancelled_after, fast_settings, final_tokens, greedy, wait_until

from pdserve import fake

PROMPT = list(range(500, 540))


def on(engines, rid: str) -> bool:
    return any(r.startswith(rid + "-") for e in engines for r in e.active_requests())


async def _client(c, rid: str, prompt: list[int], after: int | None, how: str) -> str:
    """Run one request; abort it after `after` outputs (by closing the stream, or by abort())."""
    agen = c.controller.generate({"type": "token", "prompt_token_ids": prompt}, greedy(12), rid)
    n = 0
    try:
        async for out in agen:
            n += 1
            if after is not None and n >= after:
                if how == "close":
                    await agen.aclose()
                    return "aborted"
                await c.controller.abort(rid)
                after = None  # the stream must now end promptly
            if out.finished:
                return out.outputs[0].finish_reason or ""
        return "ended"
    finally:
        await agen.aclose()


async def test_abort_while_queued_ends_at_once(make_cluster):
    cluster = await make_cluster(settings=fast_settings(fallback=False))
    await cluster.add("decode")  # no prefill worker: the request waits for one
    task = asyncio.create_task(cluster.run(PROMPT, greedy(4)))
    await asyncio.sleep(0.1)
    assert cluster.controller.active  # waiting for a prefill worker
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await cluster.assert_clean()


async def test_a_request_cancelled_as_the_pool_changes_while_it_waits_ends(make_cluster):
    cluster = await make_cluster(settings=fast_settings(fallback=False))
    await cluster.add("decode")  # no prefill worker: the request waits for the pool to change

    async def request():
        return [o async for o in cluster.controller.generate(
            {"type": "token", "prompt_token_ids": PROMPT}, greedy(4), "w1")]

    for turns in range(4):  # before, as and after its wait wakes
        task = asyncio.create_task(request())
        await wait_until(lambda: bool(cluster.controller.active), what="the request to wait")
        await asyncio.sleep(0.05)
        cluster.controller.pool.changed.set()  # a worker came or went: it looks again
        assert await cancelled_after(task, turns)
        await cluster.assert_clean()


async def test_abort_call_mid_prefill_ends_the_stream(cluster):
    p, = await cluster.add("prefill", prefill_delay_per_token=0.05)
    await cluster.add("decode")
    task = asyncio.create_task(_client(cluster, "a1", PROMPT, None, "abort"))
    await wait_until(lambda: on([p.engine], "a1"), what="prefill to start")
    await cluster.controller.abort("a1")
    assert await asyncio.wait_for(task, 2) in ("abort", "ended")
    await cluster.assert_clean()


async def test_abort_between_prefill_and_decode_releases_the_prefill_blocks(cluster):
    p, = await cluster.add("prefill")
    await cluster.add("decode")
    for how in ("close", "abort"):
        result = await asyncio.wait_for(_client(cluster, f"b-{how}", PROMPT, 1, how), 5)
        assert result in ("aborted", "abort", "ended")
        await cluster.assert_clean()  # no blocks held on the prefill engine
    # The decode leg goes out before the prefill's token is streamed, so the decode engine
    # may have read the KV before the abort comes (a loaded machine): either way, no blocks
    # are held after, which assert_clean checks.
    assert len(p.engine.served) == 2


async def test_a_prefill_aborted_as_its_engine_finishes_it_frees_its_blocks(cluster):
    # The engine has finished the prefill and holds its blocks for a decode; its last output,
    # which names them, is still on its way to the worker when the abort comes. vLLM's abort
    # of a finished request frees nothing, and the controller never hears of the blocks.
    p, = await cluster.add("prefill", last_output_delay=0.3)
    await cluster.add("decode")
    task = asyncio.create_task(_client(cluster, "h1", PROMPT, None, "abort"))
    await wait_until(lambda: p.engine.held_blocks() > 0, what="the prefill to end in its engine")
    await cluster.controller.abort("h1")
    assert await asyncio.wait_for(task, 2) in ("abort", "ended")
    await cluster.assert_clean()  # its blocks too, long before their hold would time out


async def test_abort_mid_decode_frees_the_decode_worker(cluster):
    await cluster.add("prefill")
    d, = await cluster.add("decode", decode_delay=0.01)
    for how in ("close", "abort"):
        result = await asyncio.wait_for(_client(cluster, f"c-{how}", PROMPT, 4, how), 5)
        assert result in ("aborted", "abort", "ended")
        await cluster.assert_clean()
    assert len(d.engine.served) == 2  # both reached the decode worker before the abort


async def test_cancelled_client_task_frees_everything(cluster):
    await cluster.add("prefill", prefill_delay_per_token=0.002)
    await cluster.add("decode", decode_delay=0.01)
    for delay in (0.0, 0.01, 0.05, 0.1, 0.2):
        task = asyncio.create_task(cluster.run(PROMPT, greedy(30)))
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await cluster.assert_clean()


async def test_hundreds_of_requests_aborted_at_random_points_leave_nothing(cluster):
    rng = random.Random(1234)
    await cluster.add("prefill", 2, prefill_delay_per_token=0.0005)
    await cluster.add("decode", 2, decode_delay=0.002)
    sem = asyncio.Semaphore(24)
    outcomes: dict[str, int] = {}

    async def one(i: int) -> None:
        prompt = PROMPT[: rng.randint(1, len(PROMPT))] + [i]
        how = rng.choice(["close", "abort", "cancel", "none"])
        after = rng.choice([1, 1, 2, 3, 6, 11])
        async with sem:
            if how == "cancel":
                task = asyncio.create_task(cluster.run(prompt, greedy(12), f"r{i}"))
                await asyncio.sleep(rng.choice([0, 0.001, 0.005, 0.01, 0.03]))
                task.cancel()
                res = await asyncio.gather(task, return_exceptions=True)
                if isinstance(res[0], list):  # finished before the cancel landed
                    assert final_tokens(res[0]) == fake.reference(prompt, greedy(12)).token_ids
                key = "cancel"
            else:
                key = await asyncio.wait_for(
                    _client(cluster, f"r{i}", prompt, None if how == "none" else after, how), 10)
        outcomes[key] = outcomes.get(key, 0) + 1

    await asyncio.gather(*(one(i) for i in range(300)))
    assert sum(outcomes.values()) == 300
    assert outcomes.get("length", 0) > 30  # some ran to the end
    await cluster.assert_clean()
    for e in cluster.engines():
        assert e.load().kv_usage == 0.0
    # And the pool still serves correctly.
    outs = await cluster.run(PROMPT, greedy(8))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(8)).token_ids


async def test_abort_ends_every_sequence_of_an_n_2_request(cluster):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    await cluster.add("prefill")
    await cluster.add("decode", decode_delay=0.01)
    params = SamplingParams(n=2, max_tokens=50, temperature=1.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    agen = cluster.controller.generate({"type": "token", "prompt_token_ids": PROMPT}, params,
                                       "n2")
    finish: dict[int, str | None] = {}
    async for out in agen:
        for c in out.outputs:
            finish[c.index] = c.finish_reason
        if len(finish) == 2 and "n2" in cluster.controller.active:
            await cluster.controller.abort("n2")
    assert finish == {0: "abort", 1: "abort"} and out.finished
    await cluster.assert_clean()
