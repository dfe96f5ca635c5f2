"""A pool that lost its last worker of a role keeps serving: the other role serves it whole.

A drained, restarting or dead prefill worker used to leave every new request waiting for one
(then 503) while the decode workers idled, and likewise the other way round. Now a worker of
the other role is given the whole request (the local path), unless the request is seeded (its
local prefill could kill a CPU engine, see sequence.py) or the operator turned the fallback
off. A suspect worker (late with its heartbeats) is still waited for: it may be back in a
moment.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from fakepool import fast_settings, final_tokens, greedy, wait_until
from test_liveness import mute, state
from vllm import SamplingParams

from pdserve import fake
from pdserve.controller.sequence import NO_WORKER
from pdserve.errors import NoWorkerAvailable
from pdserve.protocol import Role

PROMPT = list(range(700, 740))
NO_PREFILL, NO_DECODE = NO_WORKER[Role.PREFILL], NO_WORKER[Role.DECODE]


def routes(c, reason: str) -> float:
    return c.controller.metrics.registry.get_sample_value(
        "pdserve_routes_total", {"path": "local", "reason": reason}) or 0.0


async def test_a_pool_of_decode_workers_alone_serves_every_request(cluster):
    d, = await cluster.add("decode")
    for i in range(3):
        outs = await cluster.run(PROMPT + [i], greedy(6))
        assert final_tokens(outs) == fake.reference(PROMPT + [i], greedy(6)).token_ids
    assert len(d.engine.served) == 3 and d.engine.kv_reads == 0
    assert routes(cluster, NO_PREFILL) == 3
    await cluster.assert_clean()


async def test_requests_fall_back_while_the_prefill_worker_drains_and_not_after_one_is_back(
        cluster, caplog):
    caplog.set_level(logging.INFO, "pdserve.controller.client")
    p1, = await cluster.add("prefill")
    d, = await cluster.add("decode")
    await cluster.run(PROMPT, greedy(4))
    assert len(p1.engine.served) == 1
    drain = asyncio.create_task(p1.drain())
    await wait_until(lambda: not cluster.is_ready(p1.worker_id), what="p1 draining")
    for i in range(3):
        outs = await cluster.run(PROMPT + [i], greedy(5))
        assert final_tokens(outs) == fake.reference(PROMPT + [i], greedy(5)).token_ids
    assert len(p1.engine.served) == 1 and d.engine.kv_reads == 1
    await asyncio.wait_for(drain, 10)
    p2, = await cluster.add("prefill")
    await cluster.run(PROMPT, greedy(4))
    assert len(p2.engine.served) == 1 and d.engine.kv_reads == 2  # disaggregated again
    assert routes(cluster, NO_PREFILL) == 3
    said = [r.getMessage() for r in caplog.records if "prefill worker" in r.getMessage()]
    assert len(said) == 2, said  # once as the fallback began, once as it ended
    assert "decode workers serve new requests whole" in said[0]
    assert "ready again" in said[1]
    await cluster.assert_clean()


async def test_the_log_says_what_a_pool_that_lost_both_roles_does(cluster, caplog):
    # As `pdserve serve` stops: every worker drains at once. The second to go must not be
    # logged as leaving the first's role to serve requests whole: there is none.
    caplog.set_level(logging.INFO, "pdserve.controller.client")
    p1, = await cluster.add("prefill")
    d, = await cluster.add("decode")
    await asyncio.wait_for(asyncio.gather(p1.drain(), d.drain()), 10)
    await wait_until(lambda: not cluster.is_ready(p1.worker_id)
                     and not cluster.is_ready(d.worker_id), what="both draining")
    await cluster.add("prefill")
    said = [r.getMessage() for r in caplog.records if r.name == "pdserve.controller.client"]
    assert len(said) == 3, said
    assert "serve new requests whole" in said[0]
    assert "nor a" in said[1] and "refused (503) until one is ready" in said[1]
    assert said[2] == ("a prefill worker is ready again: it serves new requests whole until a "
                       "decode worker is")
    outs = await cluster.run(PROMPT, greedy(4))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(4)).token_ids
    assert routes(cluster, NO_DECODE) == 1
    await cluster.assert_clean()


async def test_a_request_waiting_for_a_suspect_prefill_worker_falls_back_when_it_is_dead(
        make_cluster):
    c = await make_cluster(settings=fast_settings(queue_timeout=10.0), missed=5)
    p, = await c.add("prefill")
    d, = await c.add("decode")
    mute(c, p)
    await wait_until(lambda: state(c, p.worker_id) == "suspect", 5, "p suspect")
    req = asyncio.create_task(c.run(PROMPT, greedy(5)))
    await wait_until(lambda: bool(c.controller.active), what="the request to wait")
    await asyncio.sleep(0.2)
    assert not req.done() and d.engine.served == []  # a suspect may be back: it waits
    await c.kill(p.worker_id)
    await wait_until(lambda: state(c, p.worker_id) == "dead", 10, "p dead")
    outs = await asyncio.wait_for(req, 5)
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(5)).token_ids
    assert p.engine.served == [] and len(d.engine.served) == 1
    assert routes(c, NO_PREFILL) == 1
    await c.assert_clean()


@pytest.mark.parametrize("present, missing", [("decode", "prefill"), ("prefill", "decode")])
async def test_a_seeded_request_waits_for_the_missing_role(cluster, present, missing):
    here, = await cluster.add(present)
    seeded = SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True,
                            output_kind=greedy().output_kind)
    req = asyncio.create_task(cluster.run(PROMPT, seeded))
    await wait_until(lambda: bool(cluster.controller.active), what="the request to wait")
    await asyncio.sleep(0.2)
    assert not req.done() and here.engine.served == []
    there, = await cluster.add(missing)
    outs = await asyncio.wait_for(req, 5)
    assert final_tokens(outs) == fake.reference(PROMPT, seeded).token_ids
    p, d = (here, there) if present == "prefill" else (there, here)
    assert len(p.engine.served) == 1 and d.engine.kv_reads == 1  # disaggregated
    await cluster.assert_clean()


async def test_with_the_fallback_off_a_request_waits_for_a_prefill_worker_then_fails(
        make_cluster):
    c = await make_cluster(settings=fast_settings(fallback=False, queue_timeout=0.5))
    d, = await c.add("decode")
    with pytest.raises(NoWorkerAvailable, match="no prefill worker"):
        await c.run(PROMPT, greedy(4))
    assert d.engine.served == []
    await c.assert_clean()


@pytest.mark.parametrize("fallback", [True, False])
async def test_admission_and_health_need_a_prefill_worker_only_without_the_fallback(
        make_cluster, fallback):
    from vllm.v1.engine.exceptions import EngineDeadError

    from pdserve.errors import NoWorkerReady

    c = await make_cluster(settings=fast_settings(fallback=fallback))
    await c.add("decode")
    if fallback:  # a probe must not take the controller out of service while it can serve
        c.controller.check_admission()
        await c.controller.check_health()
        await c.kill(next(iter(c.workers)))
        await wait_until(lambda: not c.pool.registry.ready(Role.DECODE, suspect=True), 10,
                         "the decode worker gone")
        with pytest.raises(NoWorkerReady, match="no decode worker"):
            c.controller.check_admission()
        with pytest.raises(EngineDeadError):
            await c.controller.check_health()
        await c.add("prefill")
        c.controller.check_admission()
        await c.controller.check_health()
        return
    with pytest.raises(NoWorkerReady, match="no prefill worker"):
        c.controller.check_admission()
    with pytest.raises(EngineDeadError):
        await c.controller.check_health()


async def test_a_pool_of_prefill_workers_alone_serves_every_request(cluster):
    p, = await cluster.add("prefill")
    for i in range(3):
        outs = await cluster.run(PROMPT + [i], greedy(6))
        assert final_tokens(outs) == fake.reference(PROMPT + [i], greedy(6)).token_ids
    assert len(p.engine.served) == 3 and p.engine.held_blocks() == 0
    assert routes(cluster, NO_DECODE) == 3
    await cluster.assert_clean()


async def test_prefill_workers_serving_whole_admit_no_more_streams_than_their_slots(
        make_cluster):
    # Without a decode worker there are no decode slots: the prefill engines' own --max-num-seqs
    # must bound what runs, else the streams beyond it wait inside the engine, first token out.
    c = await make_cluster(settings=fast_settings(queue_timeout=20.0))
    p, = await c.add("prefill", max_seqs=2, decode_delay=0.005)
    outs = await asyncio.gather(*(c.run(PROMPT + [i], greedy(12)) for i in range(6)))
    assert [len(final_tokens(o)) for o in outs] == [12] * 6
    assert p.engine.waited == 0
    assert c.controller.metrics.registry.get_sample_value("pdserve_admission_limit") == 2
    await c.assert_clean()


async def test_a_stream_whose_only_decode_worker_dies_goes_on_on_a_prefill_worker(
        make_cluster, caplog):
    caplog.set_level(logging.WARNING, "pdserve.controller.client")
    c = await make_cluster(missed=5)
    p, = await c.add("prefill")
    d, = await c.add("decode", decode_delay=0.03)
    params = greedy(60)
    req = asyncio.create_task(c.run(PROMPT, params))
    await wait_until(lambda: d.engine.active_requests(), what="the decode to start")
    await asyncio.sleep(0.3)  # some tokens out
    await c.kill(d.worker_id)
    outs = await asyncio.wait_for(req, 15)
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    assert len(p.engine.served) == 2  # its prefill, then the rest of the stream whole
    assert routes(c, NO_DECODE) == 1
    assert any("no decode worker is left: prefill workers serve new requests whole"
               in r.getMessage() for r in caplog.records)
    await c.assert_clean()


async def test_a_prefill_whose_only_decode_worker_died_meanwhile_is_served_on_a_prefill_worker(
        make_cluster):
    """The prefill's token is streamed once and the request goes on whole on a prefill
    worker. The prefill's KV, which no decode worker will read, is freed at once: with no
    decode worker to carry the release, the prefill worker is asked to free it itself."""
    c = await make_cluster(missed=5)
    p, = await c.add("prefill", prefill_delay_per_token=0.05)  # a 2 s prefill
    d, = await c.add("decode")
    params = greedy(8)
    req = asyncio.create_task(c.run(PROMPT, params))
    await wait_until(lambda: p.engine.active_requests(), what="the prefill to start")
    await c.kill(d.worker_id)
    await wait_until(lambda: state(c, d.worker_id) == "dead", 10, "d dead")
    assert not req.done()  # still prefilling
    outs = await asyncio.wait_for(req, 15)
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    assert d.engine.kv_reads == 0 and len(p.engine.served) == 2
    assert routes(c, NO_DECODE) == 1
    await c.assert_clean()
