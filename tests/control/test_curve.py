"""CurveZMQ: only processes holding the pool's keys can register, receive prompts or inject."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio
from fakepool import final_tokens, greedy

from pdserve import fake, protocol, transport
from pdserve.protocol import Role

PROMPT = list(range(600, 640))


async def test_only_workers_with_the_keys_register_and_serve(make_cluster, tmp_path):
    transport.keygen(tmp_path / "keys")
    transport.keygen(tmp_path / "other")
    keys = transport.Keys.load(tmp_path / "keys")
    c = await make_cluster(keys=keys)
    p, = await c.add("prefill", keys=keys)
    d, = await c.add("decode", keys=keys)
    no_keys = c.start("decode", worker_id="decode-nokeys")
    other = c.start("decode", worker_id="decode-otherkeys",
                    keys=transport.Keys.load(tmp_path / "other"))
    for i in range(6):
        outs = await c.run(PROMPT + [i], greedy(4))
        assert final_tokens(outs) == fake.reference(PROMPT + [i], greedy(4)).token_ids
    await asyncio.sleep(10 * c.heartbeat)  # many chances to register
    assert set(c.pool.registry.workers) == {p.worker_id, d.worker_id}
    assert no_keys.engine.served == [] and other.engine.served == []
    assert not any(link.registered for w in (no_keys, other) for link in w.links.values())
    await c.assert_clean()


async def test_a_peer_without_keys_cannot_inject(make_cluster, tmp_path):
    transport.keygen(tmp_path / "keys")
    keys = transport.Keys.load(tmp_path / "keys")
    c = await make_cluster(keys=keys)
    await c.add("prefill", keys=keys)
    d, = await c.add("decode", keys=keys)
    ctx = zmq.asyncio.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.IDENTITY, d.worker_id.encode())  # even claiming a real worker's id
    rogue.connect(c.address)
    try:
        for msg in (protocol.Drain(d.worker_id), protocol.Unregister(d.worker_id, "x"),
                    protocol.Register("rogue", Role.DECODE, "10.0.0.1", fake.fake_info())):
            rogue.send_multipart(protocol.encode(msg))
        await asyncio.sleep(0.5)
        assert c.is_ready(d.worker_id) and "rogue" not in c.pool.registry.workers
        assert await rogue.poll(200) == 0  # and it hears nothing
        outs = await c.run(PROMPT, greedy(4))
        assert final_tokens(outs) == fake.reference(PROMPT, greedy(4)).token_ids
    finally:
        ctx.destroy(0)


async def test_a_worker_cannot_register_with_a_keyed_controller_in_the_clear(make_cluster,
                                                                             tmp_path):
    transport.keygen(tmp_path / "keys")
    c = await make_cluster(keys=transport.Keys.load(tmp_path / "keys"))
    w = c.start("prefill")
    await asyncio.sleep(0.5)
    assert c.pool.registry.workers == {} and not w.links[0].registered
