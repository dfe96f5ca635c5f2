"""Every worker draining at once, as systemd's default stop (KillMode=control-group) signals
every process of the unit: a request caught between its prefill and its decode is still served
whole. Its prefill worker goes on from its own cache when no decode worker is left; a draining
prefill worker stays up until its KV has been read; a decode leg that a worker refuses as it
starts draining goes to another decode worker, the KV still where it was.

Each drained worker's engine is shut down as its drain ends, as its process would exit: a KV
read after that fails.
"""

from __future__ import annotations

import asyncio

from fakepool import final_tokens, greedy, wait_until
from test_fallback import NO_DECODE, routes

from pdserve import fake, protocol
from pdserve.worker import worker as worker_module

PROMPT = list(range(900, 940))


def drained(w) -> asyncio.Task:
    """Drain `w`; its engine goes when the drain ends, as with a worker process that exits."""
    async def drain() -> None:
        await w.drain()
        w.engine.shutdown()
    return asyncio.create_task(drain())


async def test_a_request_between_its_prefill_and_decode_when_every_worker_drains_is_served_whole(
        make_cluster):
    c = await make_cluster(missed=5)
    p, = await c.add("prefill", prefill_delay_per_token=0.05)  # a 2 s prefill
    d, = await c.add("decode")
    params = greedy(12)
    req = asyncio.create_task(c.run(PROMPT, params))
    await wait_until(lambda: p.engine.active_requests(), what="the prefill to start")
    drains = [drained(p), drained(d)]
    await wait_until(lambda: not c.is_ready(p.worker_id) and not c.is_ready(d.worker_id),
                     what="both draining")
    outs = await asyncio.wait_for(req, 15)
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    # Its prefill, then the rest on the same worker, which took it while draining.
    assert len(p.engine.served) == 2 and d.engine.kv_reads == 0
    assert routes(c, NO_DECODE) == 1
    await asyncio.wait_for(asyncio.gather(*drains), 10)


async def test_a_draining_prefill_worker_stays_until_its_kv_is_read(make_cluster, monkeypatch):
    """The decode engine reads the KV a second after the prefill ended (as a busy one does).
    The prefill worker is still there for it; the controller then says the KV was read, and
    the drain ends long before the worker would have stopped waiting on its own."""
    monkeypatch.setattr(worker_module, "HANDOFF_WAIT_S", 60.0)
    c = await make_cluster(missed=5)
    p, = await c.add("prefill", prefill_delay_per_token=0.01)
    d, = await c.add("decode", kv_read_delay=1.0)
    params = greedy(6)
    req = asyncio.create_task(c.run(PROMPT, params))
    await wait_until(lambda: p.engine.active_requests(), what="the prefill to start")
    drain = drained(p)
    outs = await asyncio.wait_for(req, 15)
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    assert d.engine.kv_reads == 1 and len(p.engine.served) == 1  # read, not prefilled again
    await asyncio.wait_for(drain, 10)


async def test_a_decode_leg_refused_as_its_worker_starts_draining_goes_to_another(
        make_cluster, monkeypatch):
    """The decode worker starts draining just as the decode leg is sent to it (its Drain and
    the leg cross): it refuses the leg, and the controller sends it to the other decode worker.
    The prefill is not run again."""
    c = await make_cluster(missed=5)
    p, = await c.add("prefill")
    d1, d2 = await c.add("decode", 2)
    send = c.pool.send
    refusing = []

    def send_as_it_drains(worker, msg, prefill_tokens=0):
        if msg.phase == protocol.Phase.DECODE and not refusing:
            w = c.workers[worker.id]
            refusing.append(w)
            w.draining = True  # what drain() does first: refuse new legs, tell the controllers
            w._tell_all(protocol.Drain(w.worker_id))
        return send(worker, msg, prefill_tokens)

    monkeypatch.setattr(c.pool, "send", send_as_it_drains)
    params = greedy(8)
    outs = await c.run(PROMPT, params)
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    other, = {d1, d2} - set(refusing)
    assert refusing[0].engine.kv_reads == 0 and other.engine.kv_reads == 1
    assert len(p.engine.served) == 1


async def test_a_prefill_worker_whose_kv_was_read_before_it_drains_does_not_wait(
        make_cluster, monkeypatch):
    monkeypatch.setattr(worker_module, "HANDOFF_WAIT_S", 60.0)
    c = await make_cluster(missed=5)
    p, = await c.add("prefill")
    d, = await c.add("decode")
    await c.run(PROMPT, greedy(4))
    assert d.engine.kv_reads == 1
    await wait_until(lambda: not p.handing, what="the prefill worker told its KV was read")
    await asyncio.wait_for(drained(p), 10)
