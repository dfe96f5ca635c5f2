"""A prefill's timeout counts its wait at the front of its worker's line, not behind it
(Pool's lines, Sequence._outputs)."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import pytest
from fakepool import fast_settings, final_tokens, greedy, retries, wait_until
from vllm.exceptions import GracefulHTTPError

from pdserve import fake
from pdserve.controller.pool import Leg, line_moved


def test_a_prefill_done_restarts_the_wait_of_the_legs_sent_after_it_only():
    legs = [Leg(f"p-{i}", None, None, prefill_tokens=10, waits_since=1.0)  # type: ignore[arg-type]
            for i in range(4)]
    line = {leg.id: leg for leg in legs}
    line_moved(line, legs[1], now=5.0)
    assert [leg.waits_since for leg in legs] == [1.0, 1.0, 5.0, 5.0]
    line_moved(line, legs[0], now=3.0)  # a later wait is never moved back
    assert [leg.waits_since for leg in legs] == [1.0, 3.0, 5.0, 5.0]


async def test_prefills_waiting_in_a_moving_line_are_not_timed_out(make_cluster):
    # Six prompts at once on an engine that prefills one at a time, 0.25 s each: the last
    # waits 1.5 s or more in all, longer than --prefill-timeout, but never 1 s without a
    # prefill ahead of it coming out. A retry would lose its place in the line for nothing.
    c = await make_cluster(settings=fast_settings(prefill_timeout=1.0))
    await c.add("prefill", prefill_in_turn=True, prefill_delay_per_token=0.005)
    await c.add("decode")
    prompts = [list(range(100 * i, 100 * i + 50)) for i in range(1, 7)]
    outs = await asyncio.gather(*(c.run(p, greedy(4)) for p in prompts))
    for p, out in zip(prompts, outs):
        assert final_tokens(out) == fake.reference(p, greedy(4)).token_ids
    assert retries(c, "prefill_retry") == 0
    await c.assert_clean()


async def test_a_prefill_is_timed_out_though_prefills_sent_after_it_come_out(make_cluster):
    # The first prompt's prefill takes 5 s, the timeout is 1 s: two short prompts sent after
    # it finishing first do not move it along (only prefills ahead of a leg do).
    c = await make_cluster(settings=fast_settings(prefill_timeout=1.0, max_retries=0))
    p, = await c.add("prefill", prefill_delay_per_token=0.005)
    await c.add("decode")
    long = asyncio.create_task(c.run(list(range(1000, 2000)), greedy(4)))
    await wait_until(lambda: len(p.engine.served) == 1)
    short = [list(range(100 * i, 100 * i + 50)) for i in (1, 2)]
    outs = await asyncio.gather(*(c.run(s, greedy(4)) for s in short))
    assert [final_tokens(o) for o in outs] == [fake.reference(s, greedy(4)).token_ids
                                              for s in short]
    with pytest.raises(GracefulHTTPError) as e:
        await long
    assert e.value.http_status == HTTPStatus.GATEWAY_TIMEOUT
    await c.assert_clean()
