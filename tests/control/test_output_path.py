"""The path from a worker's Output messages to the stream's RequestOutputs: batched receives,
a leg's step timeouts (one timer per leg), outputs that own their lists, and outputs merged
into one when the server takes them slower than they come (as vLLM's output collector does)."""

from __future__ import annotations

import asyncio
import time
from http import HTTPStatus

import pytest
import zmq
import zmq.asyncio
from fakepool import fast_settings, final_tokens, greedy
from vllm.exceptions import GracefulHTTPError
from vllm.sampling_params import RequestOutputKind

from pdserve import fake, transport
from pdserve.controller.mailbox import Mailbox
from pdserve.controller.stream import Stream
from pdserve.protocol import SeqDelta

PROMPT = list(range(40, 80))


async def test_receiver_takes_what_is_queued_in_batches():
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"w1")
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        for i in range(10):
            await dealer.send_multipart([b"head", b"body%d" % i])
        receiver = transport.Receiver(router, limit=4)
        got: list[list[bytes]] = []
        sizes = []
        while len(got) < 10:
            batch = await asyncio.wait_for(receiver.recv(), 5)
            sizes.append(len(batch))
            got += batch
        assert got == [[b"w1", b"head", b"body%d" % i] for i in range(10)]
        assert max(sizes) == 4 and sizes[0] == 4  # all ten were queued by then: whole batches
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()


async def test_a_stalled_local_leg_times_out_on_the_token_timeout(make_cluster):
    # The first wait of a local leg is the prefill timeout, each later gap the token timeout:
    # the leg's timer must move up to the shorter one.
    c = await make_cluster(settings=fast_settings(local_prefill_threshold=10**6,
                                                  prefill_timeout=30.0, token_timeout=0.3,
                                                  max_retries=1))
    await c.add("prefill")
    await c.add("decode", 2, stall_after_tokens=3)
    t0 = time.monotonic()
    with pytest.raises(GracefulHTTPError) as e:
        await c.run(PROMPT, greedy(8), timeout=10)
    assert e.value.http_status == HTTPStatus.GATEWAY_TIMEOUT
    assert time.monotonic() - t0 < 5
    await c.assert_clean()


async def test_outputs_keep_coming_past_many_timeouts_worth_of_tokens(make_cluster):
    # Each output moves the deadline on: a stream longer than its token timeout is not cut.
    c = await make_cluster(settings=fast_settings(token_timeout=0.2))
    await c.add("prefill")
    await c.add("decode", decode_delay=0.02)
    params = greedy(25)
    outs = await c.run(PROMPT, params)
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    await c.assert_clean()


def _d(tokens, finish=None):
    return SeqDelta(0, "".join(f" t{t}" for t in tokens), list(tokens), None, None, finish)


async def _read(c, params, pause: float) -> list:
    """A request's outputs, read as a server that takes `pause` per chunk would."""
    outs = []
    async for o in c.controller.generate({"type": "token", "prompt_token_ids": PROMPT}, params,
                                         f"slow-{pause}"):
        outs.append(o)
        await asyncio.sleep(pause)
    return outs


async def test_outputs_that_wait_for_a_slow_server_go_out_as_one(pd):
    params = greedy(60)
    outs = await asyncio.wait_for(_read(pd, params, 0.05), 20)
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    text = "".join(c.text for o in outs for c in o.outputs)
    assert text == fake.reference(PROMPT, params).text
    assert len(outs) < 30  # instant workers, 50 ms per chunk taken: merged
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    await pd.assert_clean()


async def test_a_server_that_keeps_up_gets_one_output_per_token(make_cluster):
    c = await make_cluster()
    await c.add("prefill")
    await c.add("decode", decode_delay=0.05)  # a stall of the test under 50 ms merges nothing
    params = greedy(20)
    outs = await asyncio.wait_for(_read(c, params, 0.0), 20)
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 20
    await c.assert_clean()


def test_a_delta_output_is_not_changed_by_what_follows():
    s = Stream("r", None, [1], RequestOutputKind.DELTA)
    s.add(_d([5, 6]))
    first = s.emit()
    s.add(_d([7], finish="length"))
    last = s.emit()
    assert first.outputs[0].token_ids == [5, 6] and first.outputs[0].text == " t5 t6"
    assert last.outputs[0].token_ids == [7] and s.tokens() == [5, 6, 7]
    assert s.seqs[0].text == " t5 t6 t7"


def test_a_cumulative_output_is_a_copy():
    s = Stream("r", None, [1], RequestOutputKind.CUMULATIVE)
    s.add(_d([5]))
    first = s.emit()
    s.add(_d([6], finish="stop"))
    assert first.outputs[0].token_ids == [5] and first.outputs[0].text == " t5"
    assert s.emit().outputs[0].token_ids == [5, 6]


async def test_a_mailbox_hands_its_items_over_in_order_and_wakes_its_reader():
    box = Mailbox()
    box.put_nowait(1)
    box.put_nowait(2)
    assert (box.get_nowait(), await box.get()) == (1, 2)
    assert box.empty()
    reader = asyncio.create_task(box.get())
    await asyncio.sleep(0)
    assert not reader.done()  # it waits for the next item
    box.put_nowait(3)
    assert await asyncio.wait_for(reader, 1) == 3


async def test_a_mailbox_keeps_what_comes_after_its_reader_was_cancelled():
    box = Mailbox()
    reader = asyncio.create_task(box.get())
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    box.put_nowait("late")  # the cancelled reader's wait must not swallow it
    assert await asyncio.wait_for(box.get(), 1) == "late"
