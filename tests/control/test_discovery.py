"""Controllers found at run time (worker/discovery.py): names, files, siblings, controllers that
join, leave, stop and die, over real sockets with fake engines."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from fakepool import cancelled_after, fast_settings, final_tokens, greedy, wait_until

from pdserve import fake
from pdserve.errors import ShuttingDown
from pdserve.worker.discovery import Discovery, split_url

PROMPT = list(range(300, 340))


# ---- the set of controllers --------------------------------------------------------------


def resolver(table: dict[str, list[str]]):
    async def resolve(host: str) -> list[str]:
        if host not in table:
            raise OSError(f"no such host {host}")
        return table[host]
    return resolve


async def test_a_name_stands_for_every_address_it_has():
    d = Discovery(["tcp://controllers.pd.svc:8001", "tcp://10.0.0.9:8001"],
                  resolver=resolver({"controllers.pd.svc": ["10.0.0.1", "10.0.0.2", "fd00::3"]}))
    assert await d.find() == {"tcp://10.0.0.1:8001", "tcp://10.0.0.2:8001",
                              "tcp://[fd00::3]:8001", "tcp://10.0.0.9:8001"}
    assert d.static() is None  # a name is looked up again each time


async def test_a_failed_lookup_keeps_what_the_source_gave_last():
    table = {"ctl": ["10.0.0.1", "10.0.0.2"]}
    d = Discovery(["tcp://ctl:8001"], resolver=resolver(table))
    assert len(await d.find()) == 2
    del table["ctl"]  # DNS down: the controllers are not retired for it
    assert await d.find() == {"tcp://10.0.0.1:8001", "tcp://10.0.0.2:8001"}
    table["ctl"] = ["10.0.0.2"]  # back, with one controller fewer
    assert await d.find() == {"tcp://10.0.0.2:8001"}


async def test_the_controllers_file_is_read_at_every_lookup(tmp_path: Path):
    f = tmp_path / "controllers"
    f.write_text("tcp://127.0.0.1:8001  # the first\n\n")
    d = Discovery(files=[f])
    assert await d.find() == {"tcp://127.0.0.1:8001"}
    f.write_text("tcp://127.0.0.1:8001\ntcp://127.0.0.1:8002\n")
    assert await d.find() == {"tcp://127.0.0.1:8001", "tcp://127.0.0.1:8002"}
    f.write_text("tcp://127.0.0.1:8002\nnot a url\n")  # a broken edit keeps the last good list
    assert await d.find() == {"tcp://127.0.0.1:8001", "tcp://127.0.0.1:8002"}
    f.write_text("tcp://127.0.0.1:8002\n")
    assert await d.find() == {"tcp://127.0.0.1:8002"}


async def test_a_lookup_cancelled_at_any_moment_ends():
    # A worker's stop cancels its discovery loop wherever it is; a cancel lost as a lookup
    # finished kept the loop going and the worker's stop waiting on it forever.
    d = Discovery(["tcp://ctl:8001"], resolver=resolver({"ctl": ["10.0.0.1"]}))
    for turns in range(4):  # before, during and after the lookup
        await cancelled_after(asyncio.create_task(d.find()), turns)


def test_a_worker_without_a_controller_or_with_a_bad_url_does_not_start():
    with pytest.raises(ValueError, match="at least one"):
        Discovery()
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        Discovery(["http://127.0.0.1:8001"])
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        Discovery(["tcp://127.0.0.1"])


# ---- workers following the set -----------------------------------------------------------


def port_of(cluster) -> int:
    return split_url(cluster.address)[1]


async def test_a_controller_added_to_the_file_gets_every_worker_and_routes(make_cluster,
                                                                           tmp_path: Path):
    a = await make_cluster()
    f = tmp_path / "controllers"
    f.write_text(a.address + "\n")
    ws = [w for role in ("prefill", "decode") for w in
          await a.add(role, 25, controllers=Discovery(files=[f]))]
    b = await make_cluster()
    f.write_text(f"{a.address}\n{b.address}\n")
    await wait_until(lambda: all(b.is_ready(w.worker_id) for w in ws), 10,
                     "all 50 workers to register with the new controller")
    b.workers.update(a.workers)
    outs = await b.run(PROMPT, greedy(5))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(5)).token_ids
    assert all(a.is_ready(w.worker_id) for w in ws)  # nothing changed for the first one
    await b.assert_clean()


async def test_a_controller_removed_from_the_file_finishes_its_streams_then_is_left(
        make_cluster, tmp_path: Path):
    a = await make_cluster()
    b = await make_cluster(settings=fast_settings(queue_timeout=0.2))
    f = tmp_path / "controllers"
    f.write_text(f"{a.address}\n{b.address}\n")
    p, = await a.add("prefill", controllers=Discovery(files=[f]))
    d, = await a.add("decode", controllers=Discovery(files=[f]), decode_delay=0.05)
    await wait_until(lambda: b.is_ready(p.worker_id) and b.is_ready(d.worker_id))
    b.workers.update(a.workers)
    stream = asyncio.create_task(b.run(PROMPT, greedy(30)))
    await wait_until(lambda: bool(d.engine.active_requests()), what="B's stream to decode")
    f.write_text(a.address + "\n")
    # B gets nothing new from the workers at once, its stream goes on to the end...
    await wait_until(lambda: b.pool.registry.workers[d.worker_id].state.value == "draining",
                     what="the decode worker to drain from B")
    outs = await stream
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(30)).token_ids
    # ...then the workers leave it, and A goes on as before.
    await wait_until(lambda: not b.pool.registry.workers, what="the workers to leave B")
    assert len(d.links) == 1 and next(iter(d.links.values())).url == a.address
    outs = await a.run(PROMPT, greedy(5))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(5)).token_ids
    await a.assert_clean()


async def test_a_worker_registers_with_the_siblings_its_controller_names(make_cluster):
    b = await make_cluster()
    a = await make_cluster(siblings=[port_of(b)])
    p, = await a.add("prefill")  # given only A's address
    d, = await a.add("decode")
    await wait_until(lambda: b.is_ready(p.worker_id) and b.is_ready(d.worker_id), 10,
                     "the workers to find B through A")
    b.workers.update(a.workers)
    outs = await b.run(PROMPT, greedy(5))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(5)).token_ids
    await b.assert_clean()


# ---- controllers that stop or die --------------------------------------------------------


async def streams_on_two(make_cluster, a_dead_after: float, a_tokens: int, b_tokens: int):
    """Controllers A and B over one 1P1D pool, a stream running on each: (A, B, the decode
    worker, A's stream, B's stream)."""
    a = await make_cluster(dead_after=a_dead_after)
    b = await make_cluster()
    p, = await a.add("prefill", controllers=[a.address, b.address])
    d, = await a.add("decode", controllers=[a.address, b.address], decode_delay=0.05)
    await wait_until(lambda: b.is_ready(p.worker_id) and b.is_ready(d.worker_id))
    b.workers.update(a.workers)
    on_a = asyncio.create_task(a.run(PROMPT, greedy(a_tokens)))
    on_b = asyncio.create_task(b.run(PROMPT + [1], greedy(b_tokens)))
    await wait_until(lambda: len(d.engine.active_requests()) == 2, what="both streams")
    return a, b, d, on_a, on_b


async def test_a_stopping_controller_frees_its_legs_on_the_workers_at_once(make_cluster):
    # dead_after 30 s: only its Leave can free the legs this soon.
    a, b, d, on_a, on_b = await streams_on_two(make_cluster, 30.0, 200, 30)
    on_a.cancel()  # as the server would, but with no Abort sent: only the Leave tells them
    a.controller.active.clear()
    await a.pool.close()
    await wait_until(lambda: len(d.engine.active_requests()) == 1, 3,
                     "the workers to drop the stopped controller's leg")
    outs = await on_b
    assert final_tokens(outs) == fake.reference(PROMPT + [1], greedy(30)).token_ids
    await b.assert_clean()


async def test_a_killed_controllers_legs_are_freed_after_its_dead_after(make_cluster):
    a, b, d, on_a, on_b = await streams_on_two(make_cluster, 1.0, 400, 60)
    # kill -9: its socket is gone without a word to anyone.
    for t in a.pool._tasks:
        t.cancel()
    a.pool.sock.close(linger=0)
    on_a.cancel()
    await wait_until(lambda: len(d.engine.active_requests()) == 1, 10,
                     "the workers to give up on the killed controller")
    outs = await on_b
    assert final_tokens(outs) == fake.reference(PROMPT + [1], greedy(60)).token_ids
    await b.assert_clean()


async def test_a_shutting_down_controller_refuses_new_requests_and_finishes_its_streams(pd):
    pd.engine(next(w for w in pd.workers if w.startswith("decode"))).decode_delay = 0.02
    stream = asyncio.create_task(pd.run(PROMPT, greedy(60)))
    await wait_until(lambda: bool(pd.controller.active), what="the stream to start")
    # vLLM's server calls shutdown from a thread with its --shutdown-timeout.
    stopper = threading.Thread(target=pd.controller.shutdown, kwargs={"timeout": 20})
    stopper.start()
    await wait_until(lambda: pd.controller._closing, what="the shutdown to begin")
    with pytest.raises(ShuttingDown):
        pd.controller.check_admission()
    with pytest.raises(Exception):
        await pd.controller.check_health()
    outs = await stream
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(60)).token_ids
    await asyncio.get_running_loop().run_in_executor(None, stopper.join, 10)
    assert not stopper.is_alive() and pd.controller.is_stopped
    await pd.assert_clean()
