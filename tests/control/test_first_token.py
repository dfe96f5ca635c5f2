"""--first-token: the prefill's token streamed at once (default), or held until the decode
worker's first output, so the stream has no pause for the KV handoff."""

from __future__ import annotations

import pytest
from fakepool import fast_settings, final_tokens, greedy
from vllm.sampling_params import RequestOutputKind

from pdserve import fake

PROMPT = list(range(300, 345))
DELTA = RequestOutputKind.DELTA


async def first_output(cluster, params):
    """The stream's first output (waiting at most 5 s for it), and the rest of the stream."""
    import asyncio

    stream = aiter(cluster.controller.generate(
        {"type": "token", "prompt_token_ids": PROMPT}, params, "ft-1"))
    first = await asyncio.wait_for(anext(stream), 5)
    return first, stream


async def test_the_prefills_token_does_not_wait_for_the_decode_worker(make_cluster):
    """By default the first token reaches the client while the decode worker has produced
    nothing; its leg was sent before the token went out."""
    c = await make_cluster(settings=fast_settings(first_token="prefill"))
    await c.add("prefill")
    [d] = await c.add("decode", stall_after_tokens=0)  # pulls the KV, then never answers
    first, stream = await first_output(c, greedy(8, DELTA))
    assert first.outputs[0].token_ids == fake.reference(PROMPT, greedy(8)).token_ids[:1]
    assert c.controller.pool.registry.workers[d.worker_id].inflight == 1  # the decode leg
    await stream.aclose()
    await c.assert_clean()


async def test_with_first_token_decode_it_goes_out_with_the_decode_workers_first(make_cluster):
    c = await make_cluster(settings=fast_settings(first_token="decode"))
    await c.add("prefill")
    await c.add("decode")
    params = greedy(8, DELTA)
    first, stream = await first_output(c, params)
    outs = [first] + [o async for o in stream]
    ref = fake.reference(PROMPT, params)
    assert len(first.outputs[0].token_ids) >= 2  # the prefill's token and the decode's first
    assert final_tokens(outs, DELTA) == ref.token_ids  # no token lost or repeated
    assert "".join(x.text for o in outs for x in o.outputs) == ref.text
    await c.assert_clean()


async def test_a_request_that_ends_at_the_prefill_is_not_held(make_cluster):
    c = await make_cluster(settings=fast_settings(first_token="decode"))
    await c.add("prefill")
    await c.add("decode")
    outs = await c.run(PROMPT, greedy(1, DELTA))
    assert final_tokens(outs, DELTA) == fake.reference(PROMPT, greedy(1)).token_ids
    assert [e.served for e in c.engines()][1] == []  # the decode worker was never asked
    await c.assert_clean()


async def test_held_token_survives_a_decode_worker_lost_before_its_first_output(make_cluster):
    import asyncio

    from fakepool import wait_until

    c = await make_cluster(settings=fast_settings(first_token="decode"))
    await c.add("prefill")
    [doomed] = await c.add("decode", stall_after_tokens=0)  # pulls the KV, then never answers
    params = greedy(10, DELTA)
    task = asyncio.ensure_future(c.run(PROMPT, params))
    await wait_until(lambda: bool(c.engine(doomed.worker_id).served), 5, "the decode leg")
    await c.add("decode")
    await c.kill(doomed.worker_id)
    outs = await task
    # The client got nothing before the loss; the retry streams every token exactly once.
    assert final_tokens(outs, DELTA) == fake.reference(PROMPT, params).token_ids
    assert "".join(x.text for o in outs for x in o.outputs) == fake.reference(PROMPT, params).text
    await c.assert_clean()
