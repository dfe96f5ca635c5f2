"""Pool membership over real sockets: spreading, draining, expiry, admission, restarts."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import zmq
from fakepool import HEARTBEAT, MISSED, fast_settings, final_tokens, greedy, wait_until

from pdserve import fake, protocol, transport
from pdserve.protocol import Role

PROMPT = list(range(200, 236))


async def test_concurrent_requests_spread_over_two_decode_workers(cluster):
    await cluster.add("prefill")
    d1, d2 = await cluster.add("decode", 2, decode_delay=0.01)
    prompts = [PROMPT + [i] for i in range(16)]
    results = await asyncio.gather(*(cluster.run(p, greedy(10)) for p in prompts))
    for p, outs in zip(prompts, results, strict=True):
        assert final_tokens(outs) == fake.reference(p, greedy(10)).token_ids
    served = Counter({w.worker_id: len(w.engine.served) for w in (d1, d2)})
    assert sum(served.values()) == 16
    assert min(served.values()) >= 4, served
    await cluster.assert_clean()


async def test_round_robin_alternates_even_when_sequential(make_cluster):
    c = await make_cluster(settings=fast_settings(prefill_policy="round_robin",
                                                  decode_policy="round_robin"))
    await c.add("prefill", 2)
    ds = await c.add("decode", 3)
    for i in range(9):
        await c.run(PROMPT + [i], greedy(3))
    assert [len(d.engine.served) for d in ds] == [3, 3, 3]


async def test_draining_worker_finishes_its_streams_and_gets_nothing_new(cluster):
    await cluster.add("prefill")
    d1, = await cluster.add("decode", decode_delay=0.02)
    long = asyncio.create_task(cluster.run(PROMPT, greedy(40)))
    await wait_until(lambda: d1.engine.active_requests(), what="a stream on d1")
    d2, = await cluster.add("decode")
    drain = asyncio.create_task(d1.drain())
    await wait_until(lambda: not cluster.is_ready(d1.worker_id), what="d1 draining")
    before = len(d1.engine.served)
    for i in range(6):
        await cluster.run(PROMPT + [i], greedy(3))
    assert len(d1.engine.served) == before
    assert len(d2.engine.served) == 6
    outs = await long  # the in-flight stream finished intact
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(40)).token_ids
    await asyncio.wait_for(drain, 10)
    await asyncio.wait_for(cluster.runs[d1.worker_id], 5)  # drained, unregistered, stopped
    await wait_until(lambda: d1.worker_id not in cluster.pool.registry.workers,
                     what="d1 unregistered")
    await cluster.assert_clean()


async def test_a_leg_refused_by_a_worker_still_ready_frees_the_kv_it_did_not_read(make_cluster):
    # d1 began draining as its leg was sent: the beat saying so is not in yet (beats 1 s apart),
    # so the controller still has it ready. The prefill's KV, unread, must not stay held.
    c = await make_cluster(heartbeat=1.0, settings=fast_settings(decode_policy="round_robin"))
    await c.add("prefill")
    d1, d2 = await c.add("decode", 2)
    d1.draining = True
    for i in range(2):  # one of the two goes to d1 first
        outs = await c.run(PROMPT + [i], greedy(4))
        assert final_tokens(outs) == fake.reference(PROMPT + [i], greedy(4)).token_ids
    assert d1.engine.served == [] and len(d2.engine.served) == 2
    await c.assert_clean()


async def test_dead_worker_is_expired_and_gets_no_request(cluster):
    await cluster.add("prefill")
    d1, d2 = await cluster.add("decode", 2)
    await cluster.kill(d1.worker_id)
    entry = cluster.pool.registry.workers[d1.worker_id]
    await wait_until(lambda: entry.state.value == "dead", 3 * HEARTBEAT * MISSED,
                     "d1 to expire")
    assert d1.worker_id not in [w.id for w in cluster.pool.registry.ready(Role.DECODE)]
    for i in range(5):
        outs = await cluster.run(PROMPT + [i], greedy(4))
        assert final_tokens(outs) == fake.reference(PROMPT + [i], greedy(4)).token_ids
    assert len(d2.engine.served) == 5 and d1.engine.served == []
    assert cluster.controller.metrics.retries.labels("prefill_retry")._value.get() == 0


async def test_a_killed_worker_is_noticed_at_once_when_a_request_needs_it(make_cluster):
    # Expiry is far away; the send to the vanished peer fails and the request goes elsewhere.
    c = await make_cluster(missed=1000, settings=fast_settings(decode_policy="round_robin"))
    await c.add("prefill")
    d1, d2 = await c.add("decode", 2)
    await c.kill(d1.worker_id)
    await asyncio.sleep(0.2)  # the controller's socket sees the disconnect
    for i in range(4):
        outs = await c.run(PROMPT + [i], greedy(4))
        assert final_tokens(outs) == fake.reference(PROMPT + [i], greedy(4)).token_ids
    assert c.pool.registry.workers[d1.worker_id].state.value == "dead"
    assert len(d2.engine.served) == 4


async def test_mismatched_worker_is_refused_names_the_field_and_stops(cluster):
    bad = cluster.start("decode", info=fake.fake_info(block_size=32))
    await asyncio.wait_for(cluster.runs[bad.worker_id], 5)  # run() returned: refused everywhere
    reason = bad.links[0].refused
    assert reason and "block_size" in reason and "32" in reason and "16" in reason
    assert bad.worker_id not in cluster.pool.registry.workers
    other = cluster.start("decode", info=fake.fake_info(model="another-model"))
    await asyncio.wait_for(cluster.runs[other.worker_id], 5)
    assert "model" in other.links[0].refused
    await cluster.add("prefill")
    await cluster.add("decode")
    await cluster.run(PROMPT, greedy(3))
    assert bad.engine.served == [] and other.engine.served == []


async def test_worker_with_the_same_id_replaces_its_stale_entry(cluster):
    await cluster.add("prefill")
    old, = await cluster.add("decode", worker_id="decode-x")
    await cluster.kill("decode-x")
    new, = await cluster.add("decode", worker_id="decode-x")
    assert cluster.pool.registry.workers["decode-x"].state.value == "ready"
    outs = await cluster.run(PROMPT, greedy(4))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(4)).token_ids
    assert len(new.engine.served) == 1 and old.engine.served == []


async def test_a_leg_sent_to_a_restarted_worker_before_it_registers_is_not_run(cluster):
    # The restarted worker's connection takes over the id before the controller has read its
    # Register: a leg sent meanwhile reaches it, though meant for the one it replaced.
    p, = await cluster.add("prefill")
    await cluster.add("decode", worker_id="decode-x")
    await cluster.kill("decode-x")
    new = cluster.start("decode", worker_id="decode-x")
    link = next(iter(new.links.values()))
    send, on_generate, registering = link.send, new._on_generate, asyncio.Event()

    def held(msg):  # its Register waits for the first leg (not a release)
        if not isinstance(msg, protocol.Register) or registering.is_set():
            send(msg)

    def first_leg(i, msg):
        on_generate(i, msg)
        if msg.phase != protocol.Phase.RELEASE and not registering.is_set():
            registering.set()
            send(new._register_msg(link))

    link.send, new._on_generate = held, first_leg  # type: ignore[method-assign]
    await wait_until(lambda: _reaches(cluster, b"decode-x"), what="the new connection")
    # A release is run all the same: any decode worker can have a prefill engine free blocks.
    p.engine._held["held-1"] = fake._Hold(PROMPT, 3, time.monotonic() + 60)
    cluster.pool.release_kv({"remote_engine_id": p.engine.engine_id,
                             "remote_request_id": "held-1"}, "release-1")
    await wait_until(lambda: p.engine.held_blocks() == 0, what="the release")
    assert not registering.is_set()
    outs = await cluster.run(PROMPT, greedy(4))
    assert registering.is_set()  # the first leg did reach it unregistered
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(4)).token_ids
    assert len(new.engine.served) == 1  # only the leg sent after its registration ran
    await cluster.assert_clean()


def _reaches(cluster, identity: bytes) -> bool:
    """A send to `identity` goes through: a connection of that id is up."""
    try:
        transport.send_nowait(cluster.pool.sock, protocol.Ping("test"), to=identity)
    except zmq.ZMQError:
        return False
    return True


async def test_a_register_resent_mid_stream_leaves_the_stream_where_it_is(cluster):
    # A worker resends Register each beat until its ack arrives; on a loaded machine the ack
    # comes after the controller has sent it legs. The resent one is not a restart.
    await cluster.add("prefill")
    d, = await cluster.add("decode", decode_delay=0.01)
    run = asyncio.create_task(cluster.run(PROMPT, greedy(40)))
    await wait_until(lambda: d.engine.active_requests(), what="the decode leg to start")
    entry = cluster.pool.registry.workers[d.worker_id]
    link = next(iter(d.links.values()))
    link.send(d._register_msg(link))
    outs = await run
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(40)).token_ids
    assert len(d.engine.served) == 1  # no second leg: nothing failed it
    assert cluster.pool.registry.workers[d.worker_id] is entry
    await cluster.assert_clean()


async def test_workers_reregister_with_a_restarted_controller(make_cluster):
    first = await make_cluster()
    ws = [*await first.add("prefill"), *await first.add("decode")]
    address = first.address
    await first.stop_controller()
    second = await make_cluster(bind=address)
    await wait_until(lambda: all(second.is_ready(w.worker_id) for w in ws), 10,
                     "workers to re-register")
    second.workers.update({w.worker_id: w for w in ws})
    outs = await second.run(PROMPT, greedy(5))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(5)).token_ids
    assert not any(first.runs[w.worker_id].done() for w in ws)  # never restarted
    await second.assert_clean()


async def test_several_controllers_share_one_pool(make_cluster):
    a = await make_cluster()
    b = await make_cluster()
    both = [a.address, b.address]
    p, = await a.add("prefill", controllers=both)
    d, = await a.add("decode", controllers=both)
    await wait_until(lambda: b.is_ready(p.worker_id) and b.is_ready(d.worker_id))
    b.workers.update(a.workers)
    prompts = [PROMPT + [i] for i in range(10)]
    results = await asyncio.gather(*(
        (a if i % 2 else b).run(pr, greedy(6)) for i, pr in enumerate(prompts)))
    for pr, outs in zip(prompts, results, strict=True):
        assert final_tokens(outs) == fake.reference(pr, greedy(6)).token_ids
    # One controller going away aborts only its own requests on the shared workers.
    slow = asyncio.create_task(a.run(PROMPT, greedy(5)))
    await b.stop_controller()
    outs = await slow
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(5)).token_ids
    await a.assert_clean()


async def test_engine_failure_reported_by_health_takes_the_worker_out(cluster):
    await cluster.add("prefill")
    d1, _ = await cluster.add("decode", 2)
    d1.engine.die()
    for i in range(6):
        outs = await cluster.run(PROMPT + [i], greedy(4))
        assert final_tokens(outs) == fake.reference(PROMPT + [i], greedy(4)).token_ids
    await wait_until(lambda: not cluster.is_ready(d1.worker_id), 5, "d1 out of the pool")
    await cluster.assert_clean()  # prefills handed to the dead engine were released
