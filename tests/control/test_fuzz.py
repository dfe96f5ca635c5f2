"""Bad input on every pdserve socket is dropped; receivers never crash or wedge, requests flow."""

from __future__ import annotations

import asyncio
import random

import msgspec
import zmq
import zmq.asyncio
from fakepool import final_tokens, greedy, wait_until

from pdserve import fake, protocol
from pdserve.protocol import ErrorKind, Load, Phase, Role

PROMPT = list(range(700, 730))


def valid_messages() -> list[protocol._Msg]:
    info = fake.fake_info()
    raw = msgspec.Raw(msgspec.msgpack.encode({"max_tokens": 3}))
    return [
        protocol.Register("w1", Role.DECODE, "127.0.0.1", info, kv_port=1, pid=2),
        protocol.RegisterAck(True, "", "c1", 0.5),
        protocol.Heartbeat("w1", Load(1, 2, 0.5), draining=True),
        protocol.Drain("w1"),
        protocol.Unregister("w1", "bye"),
        protocol.Generate("r1", Phase.DECODE, [1, 2, 3], raw,
                          {"do_remote_prefill": True, "remote_engine_id": "nowhere"}),
        protocol.Abort(["r1", "r2"]),
        protocol.Output("r1", [protocol.SeqDelta(0, " t1", [1], None, None, "length", None)],
                        finished=True, kv_transfer_params={"remote_host": "10.0.0.1"},
                        error_kind=ErrorKind.ENGINE),
    ]


def garbage(rng: random.Random, limit: int) -> list[bytes]:
    """One malformed (or merely surprising) message, as frames."""
    valid = protocol.encode(rng.choice(valid_messages()))
    kind = rng.randrange(8)
    if kind == 0:  # random bytes
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randint(1, 3))]
    if kind == 1:  # truncated body
        return [valid[0], valid[1][: rng.randrange(len(valid[1]))]]
    if kind == 2:  # wrong version
        return [bytes((rng.choice([0, 2, 255]), valid[0][1])), valid[1]]
    if kind == 3:  # unknown type
        return [bytes((protocol.PROTOCOL_VERSION, rng.choice([0, 9, 200]))), valid[1]]
    if kind == 4:  # oversized for the protocol, not yet for the socket
        return [valid[0], b"\x90" * (limit + 100)]
    if kind == 5:  # mutated bytes of a valid message
        body = bytearray(valid[1])
        for _ in range(rng.randint(1, 4)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        return [valid[0], bytes(body)]
    if kind == 6:  # frames missing or extra
        return rng.choice([[valid[0]], [*valid, b"x"], [b"", *valid]])
    return valid  # a well-formed message from a stranger


async def _requests_keep_working(c, n: int) -> None:
    for i in range(n):
        prompt = PROMPT + [i]
        outs = await c.run(prompt, greedy(5))
        assert final_tokens(outs) == fake.reference(prompt, greedy(5)).token_ids


async def test_fuzzing_the_controller_socket(make_cluster, monkeypatch):
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 256 * 1024)  # before the sockets exist
    c = await make_cluster()
    await c.add("prefill")
    await c.add("decode")
    rng = random.Random(7)
    ctx = zmq.asyncio.Context()
    fuzzer = ctx.socket(zmq.DEALER)
    fuzzer.setsockopt(zmq.LINGER, 0)
    fuzzer.setsockopt(zmq.IDENTITY, b"fuzzer")
    fuzzer.connect(c.address)

    async def fuzz():
        for i in range(2000):
            await fuzzer.send_multipart(garbage(rng, protocol.MAX_MESSAGE_BYTES))
            if i % 50 == 0:
                await asyncio.sleep(0.005)
        # Far too big for the socket: the connection is dropped, the controller lives on.
        await fuzzer.send_multipart([b"\x01\x03", b"\0" * (protocol.MAX_MESSAGE_BYTES + 8192)])

    try:
        await asyncio.gather(fuzz(), _requests_keep_working(c, 20))
        await wait_until(lambda: c.pool.dropped_messages > 500, what="garbage to be dropped")
        assert all(not t.done() for t in c.pool._tasks)  # receive and expiry loops alive
        assert set(c.pool.registry.workers) == set(c.workers)  # nothing joined or left
        await _requests_keep_working(c, 5)
        await c.assert_clean()
    finally:
        ctx.destroy(0)


async def test_fuzzing_a_worker_from_a_rogue_controller(cluster, monkeypatch):
    """A worker also serving a second, hostile controller keeps serving the real one."""
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 256 * 1024)  # before the sockets exist
    ctx = zmq.Context()  # blocking sends, so that a failed one raises here
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind("tcp://127.0.0.1:0")
    rogue_url = rogue.getsockopt(zmq.LAST_ENDPOINT).decode()
    both = [cluster.address, rogue_url]
    try:
        p, = await cluster.add("prefill", controllers=both)
        d, = await cluster.add("decode", controllers=both, decode_delay=0.002)
        peers: set[bytes] = set()

        def both_met() -> bool:  # learn the workers' identities from their Register messages
            while rogue.poll(0):
                peers.add(rogue.recv_multipart()[0])
            return len(peers) == 2

        await wait_until(both_met, what="Register messages at the rogue")
        rng = random.Random(11)

        async def fuzz():
            for i in range(1500):
                for peer in peers:
                    try:
                        rogue.send_multipart([peer, *garbage(rng, protocol.MAX_MESSAGE_BYTES)],
                                             flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                if i % 20 == 0:
                    # The ids of the real controller's legs, aborted from the rogue side.
                    live = [r for e in cluster.engines() for r in e.active_requests()]
                    rogue.send_multipart([rng.choice(sorted(peers)),
                                          *protocol.encode(protocol.Abort(live))])
                    await asyncio.sleep(0.005)

        await asyncio.gather(fuzz(), _requests_keep_working(cluster, 25))
        for w in (p, d):
            assert not cluster.runs[w.worker_id].done()
            real, = [lk for lk in w.links.values() if lk.url == cluster.address]
            assert real.registered  # still serving the real controller
        await _requests_keep_working(cluster, 5)
        await cluster.assert_clean()
    finally:
        ctx.destroy(0)


async def test_messages_claiming_another_workers_id_are_ignored(cluster):
    await cluster.add("prefill")
    d, = await cluster.add("decode", decode_delay=0.01)
    ctx = zmq.asyncio.Context()
    imp = ctx.socket(zmq.DEALER)
    imp.setsockopt(zmq.LINGER, 0)
    imp.setsockopt(zmq.IDENTITY, b"impostor")
    imp.connect(cluster.address)
    try:
        req = asyncio.create_task(cluster.run(PROMPT, greedy(20)))
        await wait_until(lambda: d.engine.active_requests(), what="decode to start")
        leg_id = next(leg for leg in cluster.pool.legs if "-d" in leg)
        dropped = cluster.pool.dropped_messages
        for msg in (protocol.Heartbeat(d.worker_id, Load(99, 99, 1.0), draining=True),
                    protocol.Drain(d.worker_id), protocol.Unregister(d.worker_id, "fake"),
                    protocol.Register(d.worker_id, Role.PREFILL, "10.6.6.6", fake.fake_info()),
                    protocol.Output(leg_id, [protocol.SeqDelta(0, " evil", [666])],
                                    finished=True)):
            await imp.send_multipart(protocol.encode(msg))
        await wait_until(lambda: cluster.pool.dropped_messages >= dropped + 4)
        outs = await req
        assert final_tokens(outs) == fake.reference(PROMPT, greedy(20)).token_ids
        w = cluster.pool.registry.workers[d.worker_id]
        assert w.state.value == "ready" and w.role == Role.DECODE and w.load.running < 99
        assert "impostor" not in cluster.pool.registry.workers
        await cluster.assert_clean()
    finally:
        ctx.destroy(0)


async def test_an_abort_naming_a_leg_twice_aborts_it(cluster, caplog):
    await cluster.add("prefill")
    d, = await cluster.add("decode", decode_delay=0.05)
    req = asyncio.create_task(cluster.run(PROMPT, greedy(200)))
    await wait_until(lambda: d.engine.active_requests(), what="decode to start")
    leg_id, = [leg for leg in cluster.pool.legs if "-d" in leg]
    worker = cluster.pool.registry.workers[d.worker_id]
    cluster.pool._reply(worker.identity, protocol.Abort([leg_id, leg_id]))
    await wait_until(lambda: not d.engine.active_requests(), 2, "the engine to drop the leg")
    assert "error handling" not in caplog.text
    req.cancel()
    await asyncio.gather(req, return_exceptions=True)
    await cluster.assert_clean()
