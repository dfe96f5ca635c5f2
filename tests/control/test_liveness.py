"""Failure detection that does not flap: silence is only suspicion; a worker is dead when its
connection is gone or it was silent for dead_after; a worker keeps a controller's requests
through late acks and drops them when the controller says it no longer knows the worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import pytest

from fakepool import fast_settings, final_tokens, greedy, retries, wait_until

from pdserve import fake, protocol
from pdserve.worker import worker as worker_mod
from pdserve.worker.engine import EngineProbe

PROMPT = list(range(600, 640))


def migrations(c) -> float:
    return retries(c, "migration")


def state(c, wid: str) -> str:
    w = c.pool.registry.workers.get(wid)
    return "gone" if w is None else w.state.value


def mute(c, w, unheard: type = protocol.Heartbeat) -> Callable[[], None]:
    """The controller stops hearing the worker's heartbeats (`unheard`), as when the worker's
    process gets no CPU for them; everything else still arrives. Returns the undo."""
    dispatch = c.pool._dispatch

    def deaf(identity: bytes, msg) -> None:
        if identity != w.worker_id.encode() or not isinstance(msg, unheard):
            dispatch(identity, msg)

    c.pool._dispatch = deaf
    return lambda: delattr(c.pool, "_dispatch")


def spy_aborts(w) -> list[str]:
    aborted: list[str] = []
    abort = w.engine.abort

    async def spy(request_ids: list[str]) -> None:
        aborted.extend(request_ids)
        await abort(request_ids)

    w.engine.abort = spy
    return aborted


async def states_while(c, wid: str, task: asyncio.Task) -> set[str]:
    seen = set()
    while not task.done():
        seen.add(state(c, wid))
        await asyncio.sleep(0.01)
    return seen


async def a_stream_on_d1(c):
    """A prefill worker, and a decode worker d1 streaming a 60-token answer; then an idle decode
    worker d2, where the stream can move. Returns (d1, d2, the answer's params, the request)."""
    await c.add("prefill")
    d1, = await c.add("decode", decode_delay=0.03)
    params = greedy(60)
    req = asyncio.create_task(c.run(PROMPT, params))
    await wait_until(lambda: d1.engine.active_requests(), what="the decode to start")
    d2, = await c.add("decode")
    return d1, d2, params, req


async def test_a_worker_streaming_outputs_is_alive_whatever_its_heartbeats(make_cluster):
    c = await make_cluster(missed=5)  # suspect after 0.5 s of silence
    await c.add("prefill")
    d, = await c.add("decode", decode_delay=0.03)
    req = asyncio.create_task(c.run(PROMPT, greedy(80)))  # ~2.4 s of tokens
    await wait_until(lambda: d.engine.active_requests(), what="the decode to start")
    mute(c, d)
    assert await states_while(c, d.worker_id, req) == {"ready"}
    outs = await req
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(80)).token_ids
    assert migrations(c) == 0 and c.pool.registry.suspicions == {"cleared": 0, "dead": 0}
    await c.assert_clean()


async def test_a_silent_connected_worker_is_suspect_gets_no_work_and_is_back_when_heard(
        make_cluster):
    c = await make_cluster(missed=5)
    await c.add("prefill")
    d1, d2 = await c.add("decode", 2)
    unmute = mute(c, d1)
    await wait_until(lambda: state(c, d1.worker_id) == "suspect", 5, "d1 suspect")
    for i in range(4):
        outs = await c.run(PROMPT + [i], greedy(4))
        assert final_tokens(outs) == fake.reference(PROMPT + [i], greedy(4)).token_ids
    assert d1.engine.served == [] and len(d2.engine.served) == 4
    assert state(c, d1.worker_id) == "suspect"  # probed all along: its connection is there
    assert d1.links[0].registered  # the probes are the controller speaking: it stays
    unmute()
    await wait_until(lambda: state(c, d1.worker_id) == "ready", 5, "d1 ready again")
    s = c.pool.registry.suspicions
    assert s["cleared"] >= 1 and s["dead"] == 0, s
    outs = await c.run(PROMPT, greedy(4))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(4)).token_ids


async def test_a_killed_worker_is_dead_within_missed_intervals_and_its_stream_migrates(
        make_cluster):
    c = await make_cluster(missed=5)  # dead_after stays 30 s: the failed probe decides
    d1, d2, params, req = await a_stream_on_d1(c)
    killed = time.monotonic()
    await c.kill(d1.worker_id)
    await wait_until(lambda: state(c, d1.worker_id) == "dead", 10, "d1 dead")
    assert time.monotonic() - killed < 5.0  # 0.5 s of silence, then one probe
    outs = await req
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    assert migrations(c) == 1 and len(d2.engine.served) == 1
    assert c.pool.registry.suspicions["dead"] == 1
    await c.assert_clean()


async def test_late_acks_do_not_make_a_worker_abort_its_requests(make_cluster, monkeypatch):
    monkeypatch.setattr(worker_mod, "MISSED_ACKS_BEFORE_LOST", 3)  # 0.3 s: the old trigger
    c = await make_cluster()
    await c.add("prefill")
    d, = await c.add("decode", decode_delay=0.03)
    aborted = spy_aborts(d)
    reply, loop = c.pool._reply, asyncio.get_running_loop()

    def late(identity: bytes, msg) -> None:  # every ack to d arrives 1.5 s late
        if identity == d.worker_id.encode() and isinstance(msg, protocol.RegisterAck):
            loop.call_later(1.5, reply, identity, msg)
        else:
            reply(identity, msg)

    c.pool._reply = late
    req = asyncio.create_task(c.run(PROMPT, greedy(80)))
    registered = set()
    while not req.done():
        registered.add(d.links[0].registered)
        await asyncio.sleep(0.01)
    outs = await req
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(80)).token_ids
    assert registered == {True} and aborted == [] and migrations(c) == 0


async def test_a_worker_the_controller_declared_dead_drops_its_legs_when_told(
        make_cluster, monkeypatch):
    monkeypatch.setattr(worker_mod, "MISSED_ACKS_BEFORE_LOST", 100)  # it never gives up itself
    c = await make_cluster(missed=3, dead_after=1.0,
                           settings=fast_settings(token_timeout=10.0))
    await c.add("prefill")
    d1, = await c.add("decode", stall_after_tokens=3)
    aborted = spy_aborts(d1)
    params = greedy(8)
    req = asyncio.create_task(c.run(PROMPT, params))
    await wait_until(lambda: d1.engine.active_requests(), what="the decode to start")
    await c.add("decode")
    # Its stream stalls and its heartbeats go unheard: nothing shows it alive, but its
    # connection is there, so it is dead only after dead_after.
    silenced = time.monotonic()
    unmute = mute(c, d1)
    await wait_until(lambda: state(c, d1.worker_id) == "dead", 10, "d1 dead")
    assert time.monotonic() - silenced > 0.9
    outs = await req  # failed over
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    assert migrations(c) == 1
    assert d1.engine.active_requests() and aborted == []  # the worker does not know yet
    unmute()  # its next heartbeat is answered "register again": the leg goes, it comes back
    await wait_until(lambda: not d1.engine.active_requests(), 5, "d1 to drop its leg")
    assert len(aborted) == 1
    await wait_until(lambda: c.is_ready(d1.worker_id), 5, "d1 registered again")
    await c.assert_clean()


def test_a_worker_gives_up_on_a_controller_only_after_its_dead_after(monkeypatch):
    monkeypatch.setattr(worker_mod, "MISSED_ACKS_BEFORE_LOST", 3)
    link = worker_mod._Link("tcp://c:1", None, registered=True, last_heard=100.0, interval=1.0,
                            dead_after=30.0)
    assert not link.gone(129.9) and link.gone(130.1)
    assert not link.gone(134.0, stall=5.0)  # this process was stalled, not the controller
    link.dead_after = 0.0  # a controller that does not say: MISSED_ACKS_BEFORE_LOST intervals
    assert not link.gone(102.9) and link.gone(103.1)
    link.registered = False
    assert not link.gone(1000.0)


class _LastStepLoad(fake.FakeEngine):
    """Reports what vLLM's stat logger keeps after the engine's last step: four requests that
    have long finished (an idle engine does not step, so nothing updates the figures)."""

    def load(self) -> protocol.Load:
        return msgspec.structs.replace(super().load(), running=4, waiting=2)


async def test_an_idle_engines_last_step_figures_do_not_make_its_worker_look_busy(cluster):
    w = cluster.start("decode")
    w.engine = _LastStepLoad(address=w.engine.address, kv_port=w.engine.kv_port)
    await wait_until(lambda: cluster.is_ready(w.worker_id))
    await cluster.add("prefill")
    await cluster.add("decode")
    beats: list[protocol.Load] = []
    dispatch = cluster.pool._dispatch

    def listen(identity: bytes, msg) -> None:
        if isinstance(msg, protocol.Heartbeat) and msg.worker_id == w.worker_id:
            beats.append(msg.load)
        dispatch(identity, msg)

    cluster.pool._dispatch = listen
    await wait_until(lambda: len(beats) >= 2, 5, "heartbeats from the new engine")
    assert [(b.running, b.waiting) for b in beats] == [(0, 0)] * len(beats)
    assert cluster.pool.registry.workers[w.worker_id].score() == 0
    # Both decode workers idle: one at a time, requests alternate between them.
    for _ in range(2):
        await cluster.run(PROMPT, greedy(3))
    assert len(w.engine.served) == 1
    await cluster.assert_clean()


def freeze(c, w) -> Callable[[], None]:
    """Stop the worker as SIGSTOP does: the controller hears nothing from it (its connection
    stays up), its engine does not step, and reads of the KV it holds wait. Returns the thaw."""
    unmute, thaw_engine = mute(c, w, unheard=object), freeze_engine(w)

    def thaw() -> None:
        unmute()
        thaw_engine()
    return thaw


def freeze_engine(w) -> Callable[[], None]:
    """Stop the worker's engine core alone (SIGSTOP to it, or a hang): the worker runs on, and
    vLLM's health check passes. Returns the thaw."""
    w.engine.thawed.clear()
    return w.engine.thawed.set


@pytest.mark.parametrize("stopped", ["worker", "engine"])
async def test_a_stream_on_a_stopped_decode_worker_moves_on_and_the_worker_comes_back(
        make_cluster, monkeypatch, stopped):
    # A worker whose engine stops holds its heartbeats (ENGINE_ANSWER_S), as silent as one
    # stopped itself. The token timeout is long: only that silence can move the stream in time.
    monkeypatch.setattr(worker_mod, "ENGINE_ANSWER_S", 0.3)
    c = await make_cluster(missed=5, move_after=1.0, settings=fast_settings(token_timeout=60.0))
    d1, d2, params, req = await a_stream_on_d1(c)
    aborted = spy_aborts(d1)
    thaw = freeze(c, d1) if stopped == "worker" else freeze_engine(d1)
    outs = await req
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    assert state(c, d1.worker_id) == "stalled"  # not dead: its connection is up
    assert migrations(c) == 1 and len(d2.engine.served) == 1
    thaw()  # it reads the abort the controller left it, and is given work again
    await wait_until(lambda: c.is_ready(d1.worker_id), 5, "d1 ready again")
    await wait_until(lambda: not d1.engine.active_requests(), 5, "d1 to drop the leg")
    assert len(aborted) == 1 and not d1.engine_stopped
    assert c.pool.registry.suspicions == {"cleared": 1, "dead": 0}
    await c.assert_clean()


async def test_a_stream_on_a_draining_worker_that_stops_moves_on_and_the_drain_ends(
        make_cluster):
    # A worker being drained (systemd's stop, a scale-down) that then stops (a paused container)
    # holds the legs it was finishing, as a ready one would; they move, and once it wakes it
    # stays out of routing and drains.
    c = await make_cluster(missed=5, move_after=1.0, settings=fast_settings(token_timeout=60.0))
    d1, d2, params, req = await a_stream_on_d1(c)
    drain = asyncio.create_task(d1.drain())
    await wait_until(lambda: state(c, d1.worker_id) == "draining", 5, "d1 draining")
    thaw = freeze(c, d1)
    outs = await req
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    assert state(c, d1.worker_id) == "stalled" and migrations(c) == 1
    thaw()
    await asyncio.wait_for(drain, 10)  # the abort it read ended its leg: nothing left to finish
    await asyncio.wait_for(c.runs[d1.worker_id], 5)
    await wait_until(lambda: d1.worker_id not in c.pool.registry.workers, 5, "d1 unregistered")
    assert len(d1.engine.served) == 1 and len(d2.engine.served) == 1
    await c.assert_clean()


async def test_a_worker_whose_engine_stays_stopped_leaves_the_pool_as_for_a_dead_engine(
        make_cluster, monkeypatch):
    # A hung engine core does not come back: past engine_hung_after its worker stops as for a
    # dead one (and exits 4, worker/main.py), so that whoever runs it starts a new one.
    monkeypatch.setattr(worker_mod, "ENGINE_ANSWER_S", 0.3)
    c = await make_cluster(missed=5, move_after=1.0, settings=fast_settings(token_timeout=60.0))
    d1, d2, params, req = await a_stream_on_d1(c)
    d1.engine_hung_after = 2.0
    freeze_engine(d1)
    assert final_tokens(await req) == fake.reference(PROMPT, params).token_ids
    await asyncio.wait_for(c.runs[d1.worker_id], 10)
    assert d1.engine_dead
    d1.engine.shutdown()  # as worker/main.py does once the worker has stopped
    await wait_until(lambda: d1.worker_id not in c.pool.registry.workers, 5, "d1 unregistered")
    assert migrations(c) == 1 and len(d2.engine.served) == 1
    await c.assert_clean()


async def test_a_frozen_lone_prefill_worker_is_a_missing_one_its_prefill_moves(make_cluster):
    c = await make_cluster(missed=5, move_after=1.0, settings=fast_settings(
        prefill_timeout=60.0, queue_timeout=60.0))
    p, = await c.add("prefill", prefill_delay_per_token=0.01)
    d, = await c.add("decode")
    first = asyncio.create_task(c.run(PROMPT, greedy(8)))
    await wait_until(lambda: p.engine.active_requests(), what="the prefill to start")
    thaw = freeze(c, p)
    # Its prefill, and a request that comes once it is stalled, are served whole by the decode
    # worker.
    await wait_until(lambda: state(c, p.worker_id) == "stalled", 5, "p stalled")
    second = await c.run(PROMPT[::-1], greedy(8))
    assert final_tokens(second) == fake.reference(PROMPT[::-1], greedy(8)).token_ids
    assert final_tokens(await first) == fake.reference(PROMPT, greedy(8)).token_ids
    assert state(c, p.worker_id) == "stalled" and len(d.engine.served) == 2
    assert retries(c, "prefill_retry") == 1
    thaw()
    await wait_until(lambda: c.is_ready(p.worker_id), 5, "p ready again")
    outs = await c.run(PROMPT + [1], greedy(8))  # disaggregated again
    assert final_tokens(outs) == fake.reference(PROMPT + [1], greedy(8)).token_ids
    assert len(p.engine.served) == 2
    await c.assert_clean()


async def test_a_read_of_kv_held_by_a_frozen_prefill_worker_gives_way_to_a_new_prefill(
        make_cluster):
    c = await make_cluster(missed=5, move_after=1.0, settings=fast_settings(token_timeout=60.0))
    p1, p2 = await c.add("prefill", 2)
    d, = await c.add("decode", kv_read_delay=0.3)  # a busy engine: it reads the KV late
    params = greedy(8)
    req = asyncio.create_task(c.run(PROMPT, params))
    await wait_until(lambda: any(w.engine.held_blocks() for w in (p1, p2)),
                     what="the prefill to hold its KV")
    holder, other = (p1, p2) if p1.engine.held_blocks() else (p2, p1)
    thaw = freeze(c, holder)
    outs = await req
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    # Prefilled again on the other prefill worker; the decode engine read that KV.
    assert len(other.engine.served) == 1 and d.engine.kv_reads == 1
    thaw()
    await wait_until(lambda: c.is_ready(holder.worker_id), 5, "the holder ready again")
    await c.assert_clean()


async def test_the_engine_probe_has_one_question_out_and_times_it():
    now = [100.0]
    answer = asyncio.Event()
    asked: list[float] = []

    async def ask() -> None:
        asked.append(now[0])
        await answer.wait()

    probe = EngineProbe(ask, clock=lambda: now[0])
    assert probe.unanswered() == 0.0  # none was out: asked now
    await asyncio.sleep(0)
    now[0] += 2.5
    assert probe.unanswered() == 2.5 and asked == [100.0]  # still out: not asked again
    answer.set()
    await asyncio.sleep(0)
    now[0] += 1.0
    assert probe.unanswered() == 0.0  # answered: asked anew
    await asyncio.sleep(0)
    assert asked == [100.0, 103.5]

    async def dead() -> None:  # an engine that died answers with its error: an answer too
        raise RuntimeError("engine dead")

    probe = EngineProbe(dead, clock=lambda: now[0])
    probe.unanswered()
    await asyncio.sleep(0)
    assert probe.unanswered() == 0.0


async def test_the_engine_probe_counts_a_busy_engine_as_stepping_through_a_long_step():
    # A step longer than the worker's patience (a big model's prefill chunk on a CPU) leaves the
    # question out while the engine computes; its CPU time says it steps. A stopped engine's
    # does not move.
    now, cpu, looks = [100.0], [5.0], []
    answer = asyncio.Event()

    def used() -> float:
        looks.append(now[0])
        return cpu[0]

    probe = EngineProbe(answer.wait, clock=lambda: now[0], cpu=used)
    assert probe.unanswered() == 0.0 and looks == []  # asked: its CPU is not read
    now[0] += 1.0
    cpu[0] += 0.9
    assert probe.unanswered() == 1.0 and looks == [101.0]  # out: from here it is
    for _ in range(20):  # 20 s of one step, a core busy
        now[0] += 1.0
        cpu[0] += 0.9
        assert probe.unanswered() == 0.0
    for waited in (1.0, 2.0, 3.0):  # stopped: no CPU, or a percent (NIXL's polling thread)
        now[0] += 1.0
        cpu[0] += 0.01
        assert probe.unanswered() == waited
    cpu[0] += 0.5  # woken: computing again
    now[0] += 1.0
    assert probe.unanswered() == 0.0
    answer.set()  # the step ends: answered, and asked anew without a look at its CPU
    await asyncio.sleep(0)
    n = len(looks)
    now[0] += 1.0
    assert probe.unanswered() == 0.0 and len(looks) == n

