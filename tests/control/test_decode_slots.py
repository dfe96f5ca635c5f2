"""Decode slots: a stream beyond what the decode engines run at once (their --max-num-seqs) waits
in the controller's line before its prefill, not inside a decode engine after its first token
(controller/admission.py). Fake engines with `max_seqs` queue requests beyond it as vLLM's
scheduler does, and count those that had to wait (`waited`)."""

from __future__ import annotations

import asyncio

import pytest
from fakepool import fast_settings, final_tokens, greedy, wait_until

PROMPT = list(range(10, 60))


async def run_all(cluster, n: int, max_tokens: int) -> list[list]:
    return await asyncio.gather(*(cluster.run(PROMPT, greedy(max_tokens)) for _ in range(n)))


async def two_controllers(make_cluster, max_seqs: int, heartbeat: float | None = None,
                          **prefill_kw):
    """Controllers A and B over one prefill worker and one decode worker of `max_seqs` slots,
    each worker registered with both; returns (A, B, the decode worker)."""
    beat = {} if heartbeat is None else {"heartbeat": heartbeat}
    a = await make_cluster(fast_settings(queue_timeout=20.0), **beat)
    b = await make_cluster(fast_settings(queue_timeout=20.0), **beat)
    both = [a.address, b.address]
    p, = await a.add("prefill", controllers=both, **prefill_kw)
    d, = await a.add("decode", controllers=both, max_seqs=max_seqs, decode_delay=0.01)
    await wait_until(lambda: b.is_ready(p.worker_id) and b.is_ready(d.worker_id), 10,
                     "both workers to register with B")
    b.workers.update(a.workers)
    return a, b, d


@pytest.mark.parametrize("says", [True, False], ids=["slots-known", "slots-unknown"])
async def test_streams_beyond_the_decode_slots_wait_before_their_prefill(make_cluster, says):
    cluster = await make_cluster(fast_settings(queue_timeout=20.0))
    await cluster.add("prefill")
    d = cluster.start("decode", max_seqs=2, decode_delay=0.005)
    if not says:  # a worker that does not report it: the engine queues the streams instead
        d.engine.max_seqs = 0  # type: ignore[attr-defined]
    await wait_until(lambda: cluster.is_ready(d.worker_id), 10, "the decode worker")

    outs = await run_all(cluster, 6, max_tokens=12)

    assert [len(final_tokens(o)) for o in outs] == [12] * 6
    engine = cluster.engine(d.worker_id)
    limit = cluster.controller.metrics.registry.get_sample_value("pdserve_admission_limit")
    if says:
        assert engine.waited == 0  # no stream waited in the engine with its first token out
        assert limit == 2
    else:
        assert engine.waited > 0
        assert limit == cluster.controller.settings.max_inflight
    await cluster.assert_clean()


async def test_a_decode_worker_that_joins_starts_the_streams_waiting_for_slots(make_cluster):
    cluster = await make_cluster(fast_settings(queue_timeout=20.0))
    await cluster.add("prefill")
    await cluster.add("decode", max_seqs=1, decode_delay=0.02)
    admission = cluster.controller.admission
    long = asyncio.create_task(cluster.run(PROMPT, greedy(150)))  # ~3 s of decode steps
    await wait_until(lambda: admission.inflight == 1, 5, "the first stream to start")
    second = asyncio.create_task(cluster.run(PROMPT, greedy(4)))
    await wait_until(lambda: admission.queued == 1, 5, "the second to wait for a slot")

    await cluster.add("decode", max_seqs=1)

    # The join alone starts it: nothing was released meanwhile.
    assert len(final_tokens(await asyncio.wait_for(second, 10))) == 4
    assert not long.done()
    assert len(final_tokens(await long)) == 150
    assert all(e.waited == 0 for e in cluster.engines())
    await cluster.assert_clean()


async def test_a_stream_goes_to_a_decode_worker_with_a_free_slot_whatever_the_policy(
        make_cluster):
    # Round robin alone would give the small worker every other stream.
    cluster = await make_cluster(fast_settings(queue_timeout=20.0,
                                               decode_policy="round_robin"))
    await cluster.add("prefill")
    small, = await cluster.add("decode", max_seqs=1, decode_delay=0.005)
    big, = await cluster.add("decode", max_seqs=3, decode_delay=0.005)

    outs = await run_all(cluster, 4, max_tokens=12)

    assert [len(final_tokens(o)) for o in outs] == [12] * 4
    assert cluster.engine(small.worker_id).waited == 0
    assert cluster.engine(big.worker_id).waited == 0
    assert len(cluster.engine(big.worker_id).served) == 3
    await cluster.assert_clean()


async def test_two_controllers_leave_each_other_the_slots_they_hold(make_cluster):
    # Each controller counts its own streams; the decode worker's heartbeat to each tells it
    # how many it holds for the others (protocol.Load.others).
    a, b, d = await two_controllers(make_cluster, max_seqs=2)
    at_a = asyncio.create_task(run_all(a, 2, max_tokens=80))  # both slots, for ~1 s
    seen_by_b = b.pool.registry.workers[d.worker_id]
    await wait_until(lambda: seen_by_b.load.others == 2, 5, "B to hear that A holds both")
    assert b.controller.admission.limit() == 0

    outs_b = await run_all(b, 3, max_tokens=12)

    assert [len(final_tokens(o)) for o in outs_b] == [12] * 3
    assert [len(final_tokens(o)) for o in await at_a] == [80] * 2
    assert d.engine.waited == 0  # type: ignore[attr-defined]  # B's waited in its line
    await a.assert_clean()
    await b.assert_clean()


async def test_streams_in_their_prefill_at_one_controller_hold_their_slots_at_the_other(
        make_cluster):
    """A burst reaching two controllers at once: A's streams still in their prefill count at
    B at once (protocol.Reserved, then Others), not a heartbeat later when they reach the decode
    worker, so B does not admit into the slots they will take."""
    beat = 3.0  # no heartbeat comes while A's prompts are prefilled: only Others can tell B
    a, b, d = await two_controllers(make_cluster, max_seqs=2, heartbeat=beat,
                                    prefill_delay_per_token=0.05)  # 2.5 s a prompt
    at_a = asyncio.create_task(run_all(a, 2, max_tokens=20))
    seen_by_b = b.pool.registry.workers[d.worker_id]
    await wait_until(lambda: seen_by_b.load.others == 2, 10, "B to hear that A reserved both")
    assert not d.engine.served  # type: ignore[attr-defined]  # A's are still in their prefill
    assert b.controller.admission.limit() == 0

    outs_b = await run_all(b, 2, max_tokens=12)

    assert [len(final_tokens(o)) for o in outs_b] == [12] * 2
    assert [len(final_tokens(o)) for o in await at_a] == [20] * 2
    assert d.engine.waited == 0  # type: ignore[attr-defined]
    await a.assert_clean()
    await b.assert_clean()


async def test_a_slot_freed_by_one_controllers_stream_goes_to_its_own_line_first(make_cluster):
    """A's stream ends while both controllers have a line: A starts its next at once, and B
    hears of the freed slot only after that (worker.FREED_AFTER), so the two do not both take
    it."""
    beat = 3.0  # no heartbeat comes between the streams: Others alone tells B
    a, b, d = await two_controllers(make_cluster, max_seqs=1, heartbeat=beat)
    at_a = asyncio.create_task(run_all(a, 3, max_tokens=30))  # one runs, two wait at A
    await wait_until(lambda: a.controller.admission.queued == 2, 5, "A's line")
    seen_by_b = b.pool.registry.workers[d.worker_id]
    await wait_until(lambda: seen_by_b.load.others == 1, 5, "B to hear that A holds the slot")
    at_b = asyncio.create_task(run_all(b, 2, max_tokens=10))

    assert [len(final_tokens(o)) for o in await at_a] == [30] * 3
    assert [len(final_tokens(o)) for o in await at_b] == [10] * 2
    assert d.engine.waited == 0  # type: ignore[attr-defined]
    await a.assert_clean()
    await b.assert_clean()
