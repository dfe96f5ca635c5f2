"""`--role auto` workers: the controller's duties for them (what the router gives each), the role
planner changing those duties from the load it sees, and streams that outlive a change."""

from __future__ import annotations

import asyncio

from fakepool import final_tokens, greedy, wait_until

from pdserve import fake
from pdserve.controller.planning import Planning
from pdserve.controller.receipts import open_receipt
from pdserve.controller.registry import WorkerState
from pdserve.planner.capacity import Slo
from pdserve.planner.costmodel import Profile
from pdserve.planner.roles import RolePlanner
from pdserve.protocol import Role

PROMPT = [50 + (7 * i) % 400 for i in range(40)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def planning(c, clock: Clock, slo: Slo = Slo(2000, 50), **kw) -> Planning:
    kw.setdefault("hold_seconds", 10.0)
    kw.setdefault("cooldown_seconds", 0.0)
    p = Planning(c.pool.registry, RolePlanner(slo, **kw), Profile(), interval=1.0, clock=clock)
    c.controller.metrics.watch_planning(p)
    return p


def duties(c) -> dict[str, str]:
    return {w.id: w.duty.label for w in c.pool.registry.workers.values()}


async def routed(c, prompt=PROMPT, n: int = 6):
    receipt = open_receipt()
    outs = await c.run(prompt, greedy(n))
    assert final_tokens(outs) == fake.reference(prompt, greedy(n)).token_ids
    return receipt[0]


async def test_auto_workers_start_serving_requests_whole(cluster):
    a, b = await cluster.add("auto", 2)
    assert duties(cluster) == {a.worker_id: "both", b.worker_id: "both"}
    r = await routed(cluster)
    assert (r.path, r.reason) == ("local", "auto")
    assert len(cluster.engine(r.decode).served) == 1
    await cluster.assert_clean()


async def test_the_planner_makes_an_idle_pair_1p1d_after_the_hold_and_requests_follow(cluster):
    clock = Clock()
    await cluster.add("auto", 2)
    p = planning(cluster, clock)
    d = p.tick()
    assert d is not None and d.status == "holding" and d.target.split.label() == "1P1D"
    assert set(duties(cluster).values()) == {"both"}  # nothing moves before hold_seconds
    clock.t += 10.0
    assert p.tick().status == "changed"  # one worker per decision, each after its own hold
    assert sorted(duties(cluster).values()) in (["both", "decode"], ["both", "prefill"])
    assert p.tick().status == "holding"
    clock.t += 10.0
    p.tick()
    assert sorted(duties(cluster).values()) == ["decode", "prefill"]
    assert p.tick().status == "steady"
    changes = cluster.controller.metrics.registry.get_sample_value(
        "pdserve_role_changes_total", {"why": "steadier"})
    assert changes == 2
    r = await routed(cluster)
    assert r.path == "disaggregated"
    assert duties(cluster)[r.prefill] == "prefill" and duties(cluster)[r.decode] == "decode"
    await cluster.assert_clean()


async def test_a_suspect_worker_keeps_its_duty_and_only_a_dead_one_is_planned_around(cluster):
    # A worker late with its heartbeats (busy cores) is suspect, not gone: the planner must not
    # turn its peer into a `both` worker and back each time it is heard again.
    clock = Clock()
    a, b = await cluster.add("auto", 2)
    reg = cluster.pool.registry
    for w, duty in ((a, Role.PREFILL), (b, Role.DECODE)):
        reg.workers[w.worker_id].duty = duty
    p = planning(cluster, clock, hold_seconds=2.0)
    for _ in range(5):
        clock.t += 1.0
        reg.workers[b.worker_id].state = WorkerState.SUSPECT  # (its heartbeats would clear it)
        assert p.tick().status == "steady"
    assert duties(cluster) == {a.worker_id: "prefill", b.worker_id: "decode"}
    # Dead: the survivor serves both sides after the hold.
    reg.mark_dead(b.worker_id)
    for _ in range(3):
        clock.t += 1.0
        p.tick()
    assert duties(cluster)[a.worker_id] == "both"
    await cluster.assert_clean()


async def test_a_saturated_decode_side_turns_the_pair_into_two_colocated_workers(cluster):
    clock = Clock()
    a, b = await cluster.add("auto", 2)
    for w, duty in ((a, Role.PREFILL), (b, Role.DECODE)):
        cluster.pool.registry.workers[w.worker_id].duty = duty
    p = planning(cluster, clock, slo=Slo(2000, 18), hold_seconds=5.0)
    for _ in range(40):  # 6 req/s of 300-token prompts and 128-token answers, seen for 40 s
        for _ in range(6):
            p.arrived(300)
            p.finished(128)
        clock.t += 1.0
        p.tick()
    assert sorted(duties(cluster).values()) == ["both", "both"]
    assert p.desired["decode"] >= 1
    await cluster.assert_clean()


async def test_a_stream_outlives_its_workers_duty_change_whole(cluster):
    a, b = await cluster.add("auto", 2, decode_delay=0.01)
    prompt, params = PROMPT, greedy(60)
    receipt = open_receipt()
    run = asyncio.create_task(cluster.run(prompt, params))
    await wait_until(lambda: any(cluster.engine(w.worker_id).active_requests()
                                 for w in (a, b)), what="the stream to start")
    host = next(w for w in (a, b) if cluster.engine(w.worker_id).active_requests())
    other = b if host is a else a
    # Mid-stream, its worker becomes a prefill worker and the other the decode worker.
    cluster.pool.registry.workers[host.worker_id].duty = Role.PREFILL
    cluster.pool.registry.workers[other.worker_id].duty = Role.DECODE
    outs = await run
    assert final_tokens(outs) == fake.reference(prompt, params).token_ids
    assert receipt[0].path == "local" and receipt[0].decode == host.worker_id
    r = await routed(cluster)  # the next request follows the new duties
    assert (r.path, r.prefill, r.decode) == ("disaggregated", host.worker_id, other.worker_id)
    await cluster.assert_clean()


async def test_a_fixed_role_worker_is_never_reassigned(cluster):
    clock = Clock()
    await cluster.add("prefill")
    await cluster.add("decode")
    p = planning(cluster, clock)
    assert p.tick() is None  # no auto worker: nothing to plan
    assert sorted(duties(cluster).values()) == ["decode", "prefill"]
    # The autoscaling signal is there all the same.
    assert cluster.controller.metrics.registry.get_sample_value(
        "pdserve_planner_desired_workers", {"role": "decode"}) >= 1


async def test_workers_report_their_decode_steps_and_the_cost_model_shows_them(cluster):
    clock = Clock()
    a, = await cluster.add("auto", 1, decode_delay=0.02)
    cluster.pool.registry.workers[a.worker_id].duty = Role.DECODE
    await cluster.add("prefill")
    p = planning(cluster, clock)
    await cluster.run(PROMPT, greedy(30))
    w = cluster.pool.registry.workers[a.worker_id]
    await wait_until(lambda: w.load.step_s > 0, what="a heartbeat with decode steps")
    assert 0.015 < w.load.step_s < 0.2 and w.load.step_running >= 1
    p.tick()
    snap = next(x for x in cluster.pool.registry.snapshot() if x["id"] == a.worker_id)
    assert snap["role"] == "auto" and snap["duty"] == "decode"
    assert snap["costs"]["decode"]["samples"] >= 1


class Recorder:
    def __init__(self) -> None:
        self.prefills: list[tuple[str, int, float]] = []

    def arrived(self, n: int) -> None: ...

    def prefilled(self, worker: str, tokens: int, seconds: float) -> None:
        self.prefills.append((worker, tokens, seconds))


def test_only_a_prefill_alone_on_its_worker_teaches_the_cost_model():
    from pdserve.controller.metrics import Metrics

    clock = Clock()
    m = Metrics(clock=clock)
    m.planning = Recorder()  # type: ignore[assignment]
    for alone in (False, True):
        t = m.timeline(100)
        t.prefill_started("p1", alone=alone)
        clock.t += 0.05
        t.prefill_done(90)
    [(worker, tokens, seconds)] = m.planning.prefills  # type: ignore[attr-defined]
    assert (worker, tokens) == ("p1", 90) and abs(seconds - 0.05) < 1e-9
