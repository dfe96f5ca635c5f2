"""--first-token: the prefill's token streamed at once (default), or held until the decode
worker's first output, so the stream has no pause for the KV handoff."""

from __future__ import annotations

import pytest
from fakepool import fast_settings, final_tokens, greedy
from vllm.sampling_params import RequestOutputKind

from pdserve import fake

PROMPT = list(range(300, 345))
DELTA = RequestOutputKind.DELTA


async def first_output_and_decode_state(cluster, params):
    """The stream's outputs, and whether the decode worker had the request when the first
    output reached the client."""
    _, d = cluster.engines()
    seen = []
    outs = []
    async for o in cluster.controller.generate(
            {"type": "token", "prompt_token_ids": PROMPT}, params, "ft-1"):
        if not outs:
            seen.append(len(d.served))
        outs.append(o)
    return outs, seen[0]


@pytest.mark.parametrize("mode, decode_started_first", [("prefill", 0), ("decode", 1)])
async def test_when_the_first_token_reaches_the_client(make_cluster, mode, decode_started_first):
    c = await make_cluster(settings=fast_settings(first_token=mode))
    await c.add("prefill")
    await c.add("decode")
    params = greedy(8, DELTA)
    outs, decode_had_it = await first_output_and_decode_state(c, params)
    assert decode_had_it == decode_started_first
    ref = fake.reference(PROMPT, params)
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
