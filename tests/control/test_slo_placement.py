"""`--placement slo`: each request placed local or disaggregated, and on which workers, by the
controller's cost models against its SLO, over fake workers (the profiles below make each
choice clear-cut; planner/placement.py's own tests check the flip points)."""

from __future__ import annotations

import asyncio

from fakepool import fast_settings, final_tokens, greedy, wait_until

from pdserve import fake
from pdserve.controller.planning import Planning
from pdserve.controller.receipts import open_receipt
from pdserve.planner.capacity import Slo
from pdserve.planner.costmodel import Profile
from pdserve.planner.roles import RolePlanner
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

PROMPT = [50 + (7 * i) % 400 for i in range(200)]
# A handoff costs a second: one handoff per stream is more TPOT than a 10-token stream allows.
SLOW_HANDOFF = Profile(prefill_base_s=0.001, prefill_per_token_s=1e-5, step_base_s=0.005,
                       step_per_running_s=0.001, step_per_kkv_s=0.0, handoff_s=1.0)
# Prefill is slow and a handoff free: a local prefill stalls the decode worker's streams.
SLOW_PREFILL = Profile(prefill_base_s=0.01, prefill_per_token_s=1e-3, step_base_s=0.005,
                       step_per_running_s=0.001, step_per_kkv_s=0.0, handoff_s=0.001)


async def slo_cluster(make_cluster, profile: Profile, slo: Slo = Slo(2000, 50), **settings):
    c = await make_cluster(settings=fast_settings(**settings))
    p = Planning(c.pool.registry, RolePlanner(slo), profile, interval=1.0)
    c.controller.metrics.watch_planning(p)
    c.controller.placer = p
    return c


async def placed(c, prompt=PROMPT, params: SamplingParams | None = None):
    params = params or greedy(10)
    receipt = open_receipt()
    outs = await c.run(prompt, params)
    assert final_tokens(outs) == fake.reference(prompt, params).token_ids
    return receipt[0]


def routes(c, path: str, reason: str) -> float:
    return c.controller.metrics.registry.get_sample_value(
        "pdserve_routes_total", {"path": path, "reason": reason}) or 0.0


async def test_a_costly_handoff_keeps_requests_local_and_says_why(make_cluster):
    c = await slo_cluster(make_cluster, SLOW_HANDOFF)
    await c.add("prefill")
    [d] = await c.add("decode")
    r = await placed(c)
    assert (r.path, r.reason, r.decode, r.prefill) == ("local", "slo_local", d.worker_id, "")
    assert c.engine(d.worker_id).served and routes(c, "local", "slo_local") == 1
    await c.assert_clean()


async def streaming(c, d):
    """A long stream running on decode worker `d` (its fake engine decodes slowly)."""
    task = asyncio.ensure_future(c.run(PROMPT[:20], greedy(400), timeout=30))
    await wait_until(lambda: c.pool.registry.workers[d.worker_id].inflight, 5, "a stream on d")
    return task


async def test_a_costly_prefill_is_disaggregated_off_a_busy_decode_worker(make_cluster):
    # With a stream running on the decode worker, a local prefill would stall it for the
    # prefill's duration; a handoff costs nothing here.
    c = await slo_cluster(make_cluster, SLOW_PREFILL)
    [p] = await c.add("prefill")
    [d] = await c.add("decode", decode_delay=0.01)
    background = await streaming(c, d)
    r = await placed(c)
    assert (r.path, r.reason) == ("disaggregated", "slo_disagg")
    assert (r.prefill, r.decode) == (p.worker_id, d.worker_id)
    assert routes(c, "disaggregated", "slo_disagg") == 1
    background.cancel()
    await c.assert_clean()


async def test_the_manual_threshold_overrides_the_kind_only(make_cluster):
    # The model would keep this prompt local; a threshold under its length disaggregates it.
    c = await slo_cluster(make_cluster, SLOW_HANDOFF, local_prefill_threshold=100)
    await c.add("prefill")
    await c.add("decode")
    assert (await placed(c)).path == "disaggregated"
    r = await placed(c, PROMPT[:50])
    assert (r.path, r.reason) == ("local", "manual_threshold")
    assert routes(c, "disaggregated", "manual_threshold") == 1
    await c.assert_clean()


async def test_a_seeded_request_keeps_to_the_rules(make_cluster):
    # The SLO would serve it local; its own generator must not see a chunked local prefill
    # on a CPU engine, so it is disaggregated as without --placement slo.
    c = await slo_cluster(make_cluster, SLOW_HANDOFF)
    await c.add("prefill")
    await c.add("decode")
    r = await placed(c, params=SamplingParams(
        max_tokens=10, temperature=1.0, seed=7, output_kind=RequestOutputKind.DELTA))
    assert (r.path, r.reason) == ("disaggregated", "")
    await c.assert_clean()


async def test_prefills_queued_on_a_worker_send_the_next_prompt_elsewhere(make_cluster):
    # Two prefill workers with slow fake prefills, a busy decode worker: while the first prompt
    # is prefilled its worker's queue is counted, so the second goes to the other prefill
    # worker; both queues are empty again once the prefills are done.
    c = await slo_cluster(make_cluster, SLOW_PREFILL)
    p1, p2 = await c.add("prefill", 2, prefill_delay_per_token=0.002)
    [d] = await c.add("decode", decode_delay=0.01)
    background = await streaming(c, d)
    first = asyncio.ensure_future(placed(c))
    reg = c.pool.registry.workers
    await wait_until(lambda: any(reg[p.worker_id].queued_prefill_tokens == len(PROMPT)
                                 for p in (p1, p2)), 5, "the first prefill counted as queued")
    second = await placed(c, PROMPT[::-1])
    r1 = await first
    assert {r1.prefill, second.prefill} == {p1.worker_id, p2.worker_id}
    assert all(w.queued_prefill_tokens == 0 for w in reg.values())
    background.cancel()
    await c.assert_clean()


async def test_a_pool_of_decode_workers_alone_serves_under_slo_placement(make_cluster):
    c = await slo_cluster(make_cluster, SLOW_PREFILL)
    [d] = await c.add("decode")
    c.controller.check_admission()  # no 503 for the missing prefill side
    r = await placed(c)
    assert (r.path, r.decode) == ("local", d.worker_id)
    assert r.reason == "least_violation" or r.reason == "slo_local"
    await c.assert_clean()


def test_a_prefill_workers_legs_are_not_streams_that_a_prefill_would_stall():
    # Eight prefills in flight on the prefill worker (their tokens no longer queued): they are
    # not decode streams, so a handoff through it costs this request no stall; one stream on
    # the decode worker makes local the worse choice.
    from pdserve.controller.registry import Registry, Worker
    from pdserve.protocol import Role

    def worker(wid: str, role: Role, inflight: int) -> Worker:
        return Worker(wid, role, "127.0.0.1", 1, fake.fake_info(), wid.encode(), 0.0, 0.0,
                      inflight=inflight)

    p, d = worker("p", Role.PREFILL, 8), worker("d", Role.DECODE, 1)
    planning = Planning(Registry(), RolePlanner(Slo(2000, 50)), SLOW_PREFILL)
    placed = planning.place(len(PROMPT), 10, [d], [p])
    assert placed is not None
    assert (placed.kind, placed.prefill_worker, placed.reason) == ("disaggregated", "p",
                                                                    "slo_disagg")


def test_the_controllers_stall_bound_reaches_the_placement():
    from pdserve.controller.registry import Registry, Worker
    from pdserve.protocol import Role

    p = Worker("p", Role.PREFILL, "127.0.0.1", 1, fake.fake_info(), b"p", 0.0, 0.0)
    d = Worker("d", Role.DECODE, "127.0.0.1", 1, fake.fake_info(), b"d", 0.0, 0.0, inflight=2)
    planning = Planning(Registry(), RolePlanner(Slo(2000, 50)), SLOW_HANDOFF)
    free = planning.place(len(PROMPT), 10, [d], [p])
    assert free is not None and free.kind == "local" and free.stall_s > 0.001
    planning.max_stall_s = 0.001  # as `--max-stall 1` sets it
    bound = planning.place(len(PROMPT), 10, [d], [p])
    assert bound is not None and (bound.kind, bound.stall_s) == ("disaggregated", 0.0)
