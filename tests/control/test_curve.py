"""CurveZMQ: only processes holding the pool's keys can register, receive prompts or inject."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from fakepool import final_tokens, greedy, wait_until

from pdserve import fake, protocol, transport
from pdserve.protocol import Role
from pdserve.worker import worker as worker_module

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


async def pool_and_stranger(make_cluster, tmp_path):
    """A pool with its keys and a decode worker registered with it, and "decode-otherkeys",
    started with other keys: the controller never answers it."""
    transport.keygen(tmp_path / "keys")
    transport.keygen(tmp_path / "other")
    keys = transport.Keys.load(tmp_path / "keys")
    c = await make_cluster(keys=keys)
    d, = await c.add("decode", keys=keys)
    stranger = c.start("decode", worker_id="decode-otherkeys",
                       keys=transport.Keys.load(tmp_path / "other"))
    return c, d, stranger


async def test_a_worker_says_when_its_registration_goes_unanswered(make_cluster, tmp_path,
                                                                   caplog, monkeypatch):
    monkeypatch.setattr(worker_module, "REGISTER_PATIENCE_S", 0.4)
    caplog.set_level(logging.WARNING, "pdserve.worker.worker")
    c, d, _ = await pool_and_stranger(make_cluster, tmp_path)

    def said() -> list[logging.LogRecord]:
        return [r for r in caplog.records
                if "has not answered this worker's registration" in r.getMessage()]

    await wait_until(lambda: len(said()) >= 2, 10, "the worker to say so twice")
    first, second = said()[:2]
    # Said by the worker with other keys only, naming the controller and what to check.
    assert all(r.getMessage().startswith(f"worker decode-otherkeys: controller {c.address} ")
               and "--keys" in r.getMessage() for r in said())
    # Once per patience (0.4 s), not at every heartbeat (HEARTBEAT, 0.1 s).
    assert second.created - first.created > 0.3
    assert c.is_ready(d.worker_id)


async def test_a_worker_that_never_registered_does_not_say_it_unregistered(make_cluster,
                                                                           tmp_path, caplog):
    caplog.set_level(logging.INFO, "pdserve.worker.worker")
    c, d, stranger = await pool_and_stranger(make_cluster, tmp_path)
    await asyncio.sleep(0.3)  # a few heartbeats' registrations, unanswered
    for w in (d, stranger):
        await w.drain()
    said = {w.worker_id: [r.getMessage() for r in caplog.records
                          if r.getMessage().startswith(f"worker {w.worker_id} drained and ")]
            for w in (d, stranger)}
    assert said == {
        d.worker_id: [f"worker {d.worker_id} drained and unregistered"],
        "decode-otherkeys": ["worker decode-otherkeys drained and stopped: no controller had "
                             "answered its registration"],
    }
