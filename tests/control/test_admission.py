"""Admission control: the pure logic with a fake clock, then through vLLM's HTTP app over a
controller with fake workers (429 + Retry-After when full, 503 on a queue timeout, never a 500)."""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus

import pytest
from fakepool import cancelled_after, fast_settings, wait_until

from pdserve.controller.admission import Admission, Slots, limits
from pdserve.errors import Overloaded, QueueTimeout, TooManySequences


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def adm(inflight: int = 2, queued: int = 2, timeout: float = 10.0, clock=None) -> Admission:
    return Admission(inflight, queued, timeout, clock=clock or Clock())


# ---- pure logic ------------------------------------------------------------------------------


def test_limits_honour_vllms_cap_on_running_plus_waiting():
    assert limits(512, 1024) == (512, 1024)
    assert limits(512, 1024, 600) == (512, 88)
    assert limits(512, 1024, 100) == (100, 0)
    assert limits(4, 0) == (4, 0)
    for bad in [(0, 10, None), (4, -1, None), (4, 4, 0)]:
        with pytest.raises(ValueError):
            limits(*bad)


def test_the_controller_flags_are_bounded_by_default_and_take_vllms_cap():
    from pdserve.controller.server import make_parser, settings_from

    def settings(*flags: str):
        return settings_from(make_parser().parse_args(["--model", "m", *flags]))

    s = settings()
    assert (s.max_inflight, s.max_queued) == (512, 1024)
    s = settings("--max-inflight", "64", "--max-queued", "0")
    assert (s.max_inflight, s.max_queued) == (64, 0)
    s = settings("--max-num-queued-reqs", "600")
    assert (s.max_inflight, s.max_queued) == (512, 88)
    with pytest.raises(ValueError):
        settings("--max-inflight", "0")


def test_slots_are_granted_up_to_max_inflight_then_requests_wait():
    a = adm(inflight=2, queued=2)
    t1, t2 = a.enter(), a.enter()
    assert t1.granted_at is not None and t2.granted_at is not None
    assert a.inflight == 2
    a.check()  # the line has room
    t3 = a.enter()
    assert t3.granted_at is None and a.queued == 1
    a.release(t1)
    assert t3.granted_at is not None and (a.inflight, a.queued) == (2, 0)


def test_a_full_line_is_refused_with_429_and_a_retry_after():
    a = adm(inflight=1, queued=2)
    a.enter()
    a.enter()
    a.enter()
    with pytest.raises(Overloaded) as e:
        a.check()
    assert e.value.http_status == HTTPStatus.TOO_MANY_REQUESTS
    assert e.value.reason == "queue_full"
    assert e.value.retry_after >= 1
    assert "capacity" in e.value.message and "retry after" in e.value.message


def test_enter_lets_requests_past_check_wait_within_the_grace_only():
    # Requests that passed check() while the line had room may arrive after it filled up.
    a = adm(inflight=1, queued=2)
    a.enter()
    waiting = [a.enter() for _ in range(2 + a.grace)]
    assert all(t.granted_at is None for t in waiting)
    with pytest.raises(Overloaded):
        a.enter()
    assert a.queued == 2 + a.grace


def test_n_counts_n_slots_and_more_than_max_inflight_is_a_400():
    a = adm(inflight=4, queued=4)
    big = a.enter(3)
    assert a.inflight == 3
    two = a.enter(2)  # does not fit beside it
    assert two.granted_at is None and a.queued == 2
    with pytest.raises(Overloaded):
        a.check(3)  # 2 + 3 > 4 waiting
    a.check(2)
    with pytest.raises(TooManySequences) as e:
        a.check(5)
    assert e.value.http_status == HTTPStatus.BAD_REQUEST
    with pytest.raises(TooManySequences):
        a.enter(5)
    a.release(big)
    assert two.granted_at is not None and a.inflight == 2


def test_waiters_are_served_first_in_first_out_and_a_big_one_is_not_overtaken():
    a = adm(inflight=3, queued=10)
    running = [a.enter() for _ in range(3)]
    big = a.enter(2)
    small = [a.enter(1) for _ in range(3)]
    a.release(running[0])  # one slot: not enough for the head (2), and nobody overtakes it
    assert big.granted_at is None and all(t.granted_at is None for t in small)
    a.release(running[1])
    assert big.granted_at is not None and all(t.granted_at is None for t in small)
    a.release(running[2])
    assert [t.granted_at is not None for t in small] == [True, False, False]
    a.release(big)
    assert all(t.granted_at is not None for t in small)
    assert (a.inflight, a.queued) == (3, 0)


def test_release_is_idempotent_and_leaving_the_line_unblocks_the_next():
    a = adm(inflight=2, queued=4)
    t1 = a.enter(1)
    a.enter(1)
    head = a.enter(2)
    nxt = a.enter(1)
    a.release(t1)  # one free slot: head (2) still waits, nxt waits behind it
    assert head.granted_at is None and nxt.granted_at is None
    a.release(head)  # head gives up (timeout or cancellation)
    assert nxt.granted_at is not None
    a.release(head)
    a.release(t1)
    assert (a.inflight, a.queued) == (2, 0)


def test_a_line_that_would_not_clear_in_half_the_queue_timeout_is_refused_early():
    clock = Clock()
    a = adm(inflight=2, queued=100, timeout=10.0, clock=clock)
    assert a.retry_after() == 1  # nothing measured yet
    for _ in range(4):  # requests hold their slots 4 s
        t = a.enter()
        clock.t += 4.0
        a.release(t)
    running = [a.enter() for _ in range(2)]
    waiting = [a.enter()]
    # 1 waiting + 1 more, 2 slots coming free per 4 s: ~4 s to wait, within half of 10 s
    assert a.expected_wait() == pytest.approx(4.0)
    a.check()
    assert a.retry_after() == 2  # the line of 1 clears in ~2 s
    waiting.append(a.enter())
    with pytest.raises(Overloaded) as e:  # ~6 s > 5 s
        a.check()
    assert e.value.reason == "expected_wait"
    assert e.value.retry_after == 4
    waiting += [a.enter() for _ in range(10)]
    assert a.retry_after() == 10  # capped at the queue timeout
    for t in running + waiting:
        a.release(t)
    assert (a.inflight, a.queued) == (0, 0)


def test_a_limit_that_falls_below_what_runs_lengthens_the_expected_wait_but_not_for_ever():
    clock = Clock()
    slots = [Slots(4, 4)]
    a = Admission(8, 100, 60.0, clock=clock, slots=lambda: slots[0])
    t = a.enter()
    clock.t += 10.0  # requests hold their slots 10 s
    a.release(t)
    running = [a.enter() for _ in range(4)]
    waiting = [a.enter() for _ in range(3)]
    assert a.expected_wait() == pytest.approx(10 * 4 / 4)  # 4 end per 10 s: ~10 s
    # Other controllers' streams now hold every slot (a burst that reached them all at once):
    # ours still end, at 4 per 10 s, and once they have, the line starts as theirs end.
    slots[0] = Slots(0, 4)
    assert a.expected_wait() == pytest.approx(10 * (4 + 4) / 4)
    a.check()  # ~20 s: within half the queue timeout, so it may wait
    for t in running + waiting:
        a.release(t)
    assert (a.inflight, a.queued) == (0, 0)


def test_the_decode_slots_lower_the_limit_and_new_slots_start_the_line():
    slots: list[Slots | None] = [Slots(2, 2)]
    a = Admission(8, 8, 10.0, clock=Clock(), slots=lambda: slots[0])
    running = [a.enter(), a.enter()]
    third = a.enter()  # max_inflight has room, the decode engines do not
    assert third.granted_at is None and a.limit() == 2
    with pytest.raises(Overloaded) as e:
        a.check(8)
    assert "the decode workers run 2 at once" in e.value.message
    slots[0] = Slots(3, 3)  # a decode worker joined
    a.refresh()
    assert third.granted_at is not None and a.inflight == 3
    slots[0] = None  # none ready (or one that does not say): max_inflight alone
    assert a.limit() == 8 and a.enter().granted_at is not None
    for t in [*running, third]:
        a.release(t)


def test_a_request_for_more_sequences_than_the_decode_slots_runs_alone():
    a = Admission(8, 8, 10.0, clock=Clock(), slots=lambda: Slots(2, 2))
    first = a.enter()
    big = a.enter(4)
    after = a.enter()
    assert big.granted_at is None
    a.release(first)
    assert big.granted_at is not None and after.granted_at is None
    a.release(big)
    assert after.granted_at is not None


def test_slots_other_controllers_hold_wait_for_them_even_with_nothing_running_here():
    slots = [Slots(free=0, total=2)]  # another controller holds both
    a = Admission(8, 8, 10.0, clock=Clock(), slots=lambda: slots[0])
    first = a.enter()
    assert first.granted_at is None and a.limit() == 0
    with pytest.raises(Overloaded) as e:
        a.check(8)
    assert "the decode workers run 2 at once, other controllers hold 2 of them" in e.value.message
    big = a.enter(3)  # more than all the slots: it could never fit, so it runs alone
    slots[0] = Slots(free=1, total=2)  # a heartbeat: one of theirs ended
    a.refresh()
    assert first.granted_at is not None and big.granted_at is None
    a.release(first)
    assert big.granted_at is not None
    a.release(big)
    assert (a.inflight, a.queued) == (0, 0)


async def test_acquire_waits_for_a_slot_in_order():
    a = adm(inflight=1, queued=4)
    first = await a.acquire()
    order: list[int] = []

    async def waiter(i: int):
        t = await a.acquire()
        order.append(i)
        await asyncio.sleep(0)
        a.release(t)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await wait_until(lambda: a.queued == 3, 2, "three waiters")
    a.release(first)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert (a.inflight, a.queued) == (0, 0)


async def test_a_waiter_gives_up_after_the_queue_timeout_with_a_503():
    a = adm(inflight=1, queued=4, timeout=0.05)
    held = await a.acquire()
    with pytest.raises(QueueTimeout) as e:
        await a.acquire()
    assert e.value.http_status == HTTPStatus.SERVICE_UNAVAILABLE
    assert e.value.reason == "queue_timeout" and e.value.retry_after >= 1
    assert "queue timeout" in e.value.message
    assert (a.inflight, a.queued) == (1, 0)
    a.release(held)
    assert a.inflight == 0


async def test_a_cancelled_waiter_leaves_the_line():
    a = adm(inflight=1, queued=4, timeout=30.0)
    held = await a.acquire()
    task = asyncio.create_task(a.acquire(1))
    behind = asyncio.create_task(a.acquire(1))
    await wait_until(lambda: a.queued == 2, 2, "two waiters")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert a.queued == 1
    a.release(held)
    t = await asyncio.wait_for(behind, 2)
    assert (a.inflight, a.queued) == (1, 0)
    a.release(t)
    assert a.inflight == 0


async def test_a_waiter_cancelled_as_its_slot_comes_is_cancelled_and_frees_it():
    # The client goes away just as a slot frees: its request must end there, not go on to run
    # for nobody, and the slot must come back.
    for turns in range(4):  # before, as and after the waiter wakes
        a = adm(inflight=1, queued=4, timeout=30.0)
        held = await a.acquire()
        waiter = asyncio.create_task(a.acquire(1))
        await wait_until(lambda: a.queued == 1, 2, "the waiter")
        a.release(held)  # grants the waiter's slot
        if not await cancelled_after(waiter, turns):
            a.release(waiter.result())  # it had its slot before the cancel
        assert (a.inflight, a.queued) == (0, 0)


# ---- through vLLM's HTTP app over a controller with fake workers -----------------------------


def body(model: str, max_tokens: int = 20, stream: bool = False, n: int = 1) -> dict:
    return {"model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, "n": n}


def rejections(c, reason: str) -> float:
    v = c.controller.metrics.registry.get_sample_value("pdserve_admission_rejections_total",
                                                       {"reason": reason})
    return v or 0.0


async def test_over_capacity_gets_429_with_retry_after_and_the_admitted_complete(http,
                                                                              vllm_config):
    model = vllm_config.model_config.model
    c, client = await http(fast_settings(max_inflight=2, max_queued=2, queue_timeout=30.0))
    await c.add("prefill")
    await c.add("decode", decode_delay=0.05)  # 20 tokens: about a second per request
    admitted = [asyncio.create_task(client.post("/v1/completions", json=body(model, stream=s)))
                for s in (False, True, False, True)]
    adm_ = c.controller.admission
    await wait_until(lambda: (adm_.inflight, adm_.queued) == (2, 2), 10, "2 running, 2 waiting")

    refused = await asyncio.gather(*[client.post("/v1/completions", json=body(model, stream=s))
                                     for s in (False, True, False)])
    for r in refused:
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == 429 and "capacity" in err["message"]
    assert rejections(c, "queue_full") == 3

    too_big = await client.post("/v1/completions", json=body(model, n=3))
    assert too_big.status_code == 400 and "--max-inflight" in too_big.json()["error"]["message"]

    for r in await asyncio.gather(*admitted):
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("application/json"):
            assert r.json()["choices"][0]["finish_reason"] == "length"
        else:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            assert not any("error" in e for e in events), events
            assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert (adm_.inflight, adm_.queued) == (0, 0)

    # After the burst the pool serves as usual.
    again = await client.post("/v1/completions", json=body(model, max_tokens=4))
    assert again.status_code == 200, again.text
    await c.assert_clean()


async def one_slot_taken(http, model: str):
    """A controller with one slot and a 0.3 s queue timeout, its slot held by a request of about
    a second (20 tokens): (cluster, client, that request's task)."""
    c, client = await http(fast_settings(max_inflight=1, max_queued=4, queue_timeout=0.3))
    await c.add("prefill")
    await c.add("decode", decode_delay=0.05)
    first = asyncio.create_task(client.post("/v1/completions", json=body(model)))
    await wait_until(lambda: c.controller.admission.inflight == 1, 10, "the first to start")
    return c, client, first


@pytest.mark.parametrize("stream,api", [(False, "completions"), (True, "completions"),
                                        (True, "chat/completions")])
async def test_a_request_that_waits_out_the_queue_timeout_gets_503_with_retry_after(
        http, vllm_config, stream, api, caplog):
    """Streamed too: the wait happens after vLLM's server has started the stream, but the
    refusal still goes out as a 503 of its own, not as an error event inside a 200; vLLM's
    stream generator logs it in one line, as a warning."""
    model = vllm_config.model_config.model
    c, client, first = await one_slot_taken(http, model)
    request = body(model, stream=stream)
    if api == "chat/completions":  # vLLM's chat stream sends its role chunk after the output
        del request["prompt"]
        request["messages"] = [{"role": "user", "content": "hello"}]
    late = await client.post(f"/v1/{api}", json=request)
    assert late.status_code == 503, late.text
    assert late.headers["content-type"] == "application/json"
    assert int(late.headers["retry-after"]) >= 1
    assert late.headers["x-pdserve-controller"] == c.controller.pool.id
    assert late.json()["error"]["code"] == 503
    assert "queue timeout" in late.json()["error"]["message"]
    if stream:
        [record] = [r for r in caplog.records if "QueueTimeout" in r.getMessage()]
        assert record.levelno == logging.WARNING and record.exc_info is None
    assert rejections(c, "queue_timeout") == 1
    assert (await first).status_code == 200
    assert c.controller.admission.queued == 0
    await c.assert_clean()


@pytest.mark.parametrize("fallback", [True, False])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_pool_without_a_ready_worker_answers_503_with_the_role_and_retry_after(
        http, vllm_config, stream, fallback):
    """A request before the workers are up (a pool starting) or after the last of a role left:
    503 naming the role, with Retry-After, before any stream begins. Decode workers alone
    serve, unless the prefill fallback is off."""
    from pdserve.errors import NO_WORKER_RETRY_AFTER_S

    model = vllm_config.model_config.model
    c, client = await http(fast_settings(fallback=fallback))
    r = await client.post("/v1/completions", json=body(model, stream=stream))
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == str(NO_WORKER_RETRY_AFTER_S)
    missing = "decode" if fallback else "prefill"
    assert f"no {missing} worker is available" in r.json()["error"]["message"]
    if not fallback:
        await c.add("prefill")
        r = await client.post("/v1/completions", json=body(model, stream=stream))
        assert r.status_code == 503 and "no decode worker" in r.json()["error"]["message"]
    await c.add("decode")
    r = await client.post("/v1/completions", json=body(model, max_tokens=4, stream=stream))
    assert r.status_code == 200, r.text
    await c.assert_clean()


async def test_openais_client_retries_a_streamed_queue_timeout_and_is_served(http, vllm_config):
    """OpenAI's Python client with its defaults (2 retries on 429 and 5xx, after Retry-After):
    a streamed request that waits out the queue timeout gets a 503 it can retry, and the retry
    is served. An error event inside a 200 stream would end it with an APIError instead."""
    import httpx2
    import openai

    model = vllm_config.model_config.model
    c, client, first = await one_slot_taken(http, model)
    app = client._transport.app  # the same vLLM app, through the transport OpenAI's client uses
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                  base_url="http://pdserve/v1") as h2:
        oai = openai.AsyncOpenAI(base_url="http://pdserve/v1", api_key="none", http_client=h2)
        stream = await oai.completions.create(model=model, prompt=[5, 6, 7], max_tokens=4,
                                              temperature=0, stream=True)
        finishes = [ch.finish_reason async for chunk in stream for ch in chunk.choices]
    assert finishes[-1] == "length"
    assert rejections(c, "queue_timeout") >= 1  # the first try waited out the timeout
    assert (await first).status_code == 200
    await c.assert_clean()
