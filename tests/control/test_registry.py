"""Pool membership as pure logic, with a fake clock: admission, suspicion, verdicts."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.controller.registry import Registry, WorkerState
from pdserve.protocol import EngineInfo, Load, Register, Role

INFO = EngineInfo("m", "m", 16, "float32", "nixl", 4096)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def reg(clock):
    return Registry(INFO, heartbeat_interval=1.0, missed=3, dead_after=30.0, forget_after=60.0,
                    clock=clock)


def register(reg, wid: str, role=Role.DECODE, info=INFO, identity: bytes | None = None,
             session: str = "s1"):
    return reg.register(Register(wid, role, "10.0.0.1", info, kv_port=5600, pid=7,
                                 session=session), identity or wid.encode())


NOTHING = ([], [], [], [])  # an Expiry that found nothing


def tick(reg, clock, seconds: float, step: float = 0.5) -> tuple[set, set, set, set]:
    """Let time pass with a check every `step` (the pool's pace); the ids each list named
    (suspected, dead, probed, stalled)."""
    found: tuple[set, set, set, set] = (set(), set(), set(), set())
    for _ in range(round(seconds / step)):
        clock.t += step
        for ids, workers in zip(found, reg.expire()):
            ids.update(w.id for w in workers)
    return found


def test_register_makes_a_ready_worker(reg, clock):
    w, note = register(reg, "d1")
    assert note == "" and w.state == WorkerState.READY and w.last_seen == clock.t
    assert [x.id for x in reg.ready(Role.DECODE)] == ["d1"] and reg.ready(Role.PREFILL) == []
    assert reg.by_identity(b"d1") is w and reg.by_identity(b"nobody") is None


def test_both_role_serves_either_side(reg):
    register(reg, "b1", Role.BOTH)
    register(reg, "p1", Role.PREFILL)
    assert {w.id for w in reg.ready(Role.PREFILL)} == {"b1", "p1"}
    assert {w.id for w in reg.ready(Role.DECODE)} == {"b1"}


@pytest.mark.parametrize("field, value", [("model", "other"), ("tokenizer", "t2"),
                                          ("block_size", 32), ("dtype", "bfloat16"),
                                          ("kv_connector", "lmcache"), ("max_model_len", 8)])
def test_mismatch_is_refused_naming_the_field(reg, field, value):
    w, reason = register(reg, "d1", info=msgspec.structs.replace(INFO, **{field: value}))
    assert w is None and field in reason and repr(value) in reason
    assert reg.workers == {}


def test_no_expected_info_admits_anything(clock):
    reg = Registry(None, clock=clock)
    w, _ = register(reg, "d1", info=msgspec.structs.replace(INFO, model="x"))
    assert w is not None


def test_heartbeat_updates_load_and_keeps_alive(reg, clock):
    register(reg, "d1")
    for _ in range(10):
        clock.t += 2.5
        w = reg.heartbeat("d1", Load(2, 1, 0.5), draining=False)
        assert reg.expire() == NOTHING
    assert w.load == Load(2, 1, 0.5) and w.last_seen == clock.t and w.score() == 3


def test_silence_is_suspicion_after_missed_intervals_exactly(reg, clock):
    register(reg, "d1")
    register(reg, "d2")
    clock.t += 3.0  # silent for exactly missed * interval: not yet
    reg.heartbeat("d2", Load(), False)
    assert reg.expire() == NOTHING and reg.workers["d1"].state == WorkerState.READY
    clock.t += 0.01
    found = reg.expire()
    assert [w.id for w in found.suspected] == ["d1"] and [w.id for w in found.probe] == ["d1"]
    assert found.dead == [] and reg.workers["d1"].state == WorkerState.SUSPECT
    # No new work for it, but it is not gone: its legs keep running, and it may come back.
    assert [w.id for w in reg.ready(Role.DECODE)] == ["d2"]
    assert {w.id for w in reg.ready(Role.DECODE, suspect=True)} == {"d1", "d2"}
    assert reg.counts() == {("decode", "suspect"): 1, ("decode", "ready"): 1}
    # Suspected once, probed at every check until it speaks or is dead.
    clock.t += 0.5
    found = reg.expire()
    assert found.suspected == [] and [w.id for w in found.probe] == ["d1"]


def test_a_suspect_that_speaks_is_ready_again_and_counted_as_a_false_suspicion(reg, clock):
    register(reg, "d1")
    assert tick(reg, clock, 3.5)[0] == {"d1"}
    clock.t += 0.2
    assert reg.heard("d1") is True  # e.g. an Output of one of its legs
    w = reg.workers["d1"]
    assert w.state == WorkerState.READY and w.last_seen == clock.t
    assert reg.suspicions == {"cleared": 1, "dead": 0}
    assert reg.heard("d1") is False  # nothing to clear
    # A heartbeat clears a suspicion too, and so does a drain (which then takes effect).
    tick(reg, clock, 3.5)
    assert reg.heartbeat("d1", Load(1, 0, 0.1), False).state == WorkerState.READY
    tick(reg, clock, 3.5)
    assert reg.drain("d1").state == WorkerState.DRAINING
    assert reg.suspicions == {"cleared": 3, "dead": 0}
    assert reg.heard("ghost") is False


def test_a_suspect_silent_for_move_after_is_stalled_until_heard(reg, clock):
    register(reg, "d1")
    register(reg, "d2")
    suspected, dead, probed, stalled = tick(reg, clock, 10.0)
    assert suspected == probed == {"d1", "d2"} and dead == stalled == set()
    reg.heartbeat("d2", Load(), False)
    clock.t += 0.01
    found = reg.expire()
    assert [w.id for w in found.stalled] == ["d1"] and [w.id for w in found.probe] == ["d1"]
    assert found.dead == [] and reg.workers["d1"].state == WorkerState.STALLED
    # Not a worker that may be back in a moment: a role of stalled workers only is missing.
    assert [w.id for w in reg.ready(Role.DECODE, suspect=True)] == ["d2"]
    assert reg.counts() == {("decode", "stalled"): 1, ("decode", "ready"): 1}
    # Stalled once, probed at every check until it speaks or is dead.
    assert tick(reg, clock, 1.0)[2:] == ({"d1"}, set())
    assert reg.heard("d1") is True and reg.workers["d1"].state == WorkerState.READY
    assert reg.suspicions == {"cleared": 2, "dead": 0}


def test_dead_only_after_dead_after_of_silence(reg, clock):
    register(reg, "d1")
    suspected, dead, probed, stalled = tick(reg, clock, 30.0)
    assert suspected == probed == stalled == {"d1"} and dead == set()
    assert reg.workers["d1"].state == WorkerState.STALLED
    suspected, dead, probed, stalled = tick(reg, clock, 0.5)
    assert dead == {"d1"} and reg.workers["d1"].state == WorkerState.DEAD
    assert reg.suspicions == {"cleared": 0, "dead": 1}
    assert tick(reg, clock, 1.0) == (set(), set(), set(), set())  # reported once, not probed
    # A verdict stands: the dead worker's messages are not heard, its heartbeat is refused
    # (it must register again) ...
    assert reg.heard("d1") is False and reg.heartbeat("d1", Load(), False) is None
    # ... and its entry is forgotten forget_after seconds after it was last heard of.
    tick(reg, clock, 28.5)
    assert "d1" in reg.workers
    tick(reg, clock, 0.5)
    assert "d1" not in reg.workers


def test_a_failed_probe_is_the_verdict(reg, clock):
    register(reg, "d1")
    tick(reg, clock, 3.5)
    register(reg, "d2")
    assert reg.mark_dead("d1").state == WorkerState.DEAD  # the pool: its connection is gone
    assert reg.mark_dead("d2").state == WorkerState.DEAD  # a send failed: never suspected
    assert reg.suspicions == {"cleared": 0, "dead": 1}


def test_a_late_check_does_not_count_the_controllers_own_stall(reg, clock):
    register(reg, "d1")
    tick(reg, clock, 2.0)
    reg.heartbeat("d1", Load(), False)
    # The controller stalls for 5 s: the worker's heartbeats from that time wait unread.
    clock.t += 5.0
    assert reg.expire() == NOTHING
    # Checks at the usual pace again: if they are still not heard, they are suspect.
    clock.t += 0.5
    assert [w.id for w in reg.expire().suspected] == ["d1"]


def test_unknown_worker_heartbeat_is_refused(reg):
    assert reg.heartbeat("ghost", Load(), False) is None


def test_drain_takes_a_worker_out_of_routing(reg, clock):
    register(reg, "d1")
    register(reg, "d2")
    clock.t += 1
    assert reg.drain("d1").state == WorkerState.DRAINING
    assert reg.workers["d1"].last_seen == clock.t
    assert [w.id for w in reg.ready(Role.DECODE)] == ["d2"]
    reg.heartbeat("d2", Load(), draining=True)  # a heartbeat can say so too
    assert reg.ready(Role.DECODE) == [] and reg.ready(Role.DECODE, suspect=True) == []
    assert reg.drain("ghost") is None
    # Silent draining workers are probed (they get no new work anyway), never suspected...
    suspected, dead, probed, stalled = tick(reg, clock, 9.0)
    assert suspected == dead == stalled == set() and probed == {"d1", "d2"}
    assert reg.workers["d1"].state == WorkerState.DRAINING


def test_a_silent_draining_worker_is_stalled_then_drains_again_when_heard(reg, clock):
    """The legs a draining worker was finishing move when it goes silent for move_after, as a
    ready worker's do; heard from again it is still draining, not given new work."""
    register(reg, "d1")
    register(reg, "d2")
    reg.drain("d1")
    reg.heartbeat("d2", Load(), draining=True)
    suspected, dead, probed, stalled = tick(reg, clock, 11.0)
    assert stalled == probed == {"d1", "d2"} and suspected == dead == set()
    assert reg.counts() == {("decode", "stalled"): 2}
    assert reg.heard("d1") and reg.workers["d1"].state == WorkerState.DRAINING
    reg.heartbeat("d2", Load(), draining=True)
    assert reg.workers["d2"].state == WorkerState.DRAINING and reg.ready(Role.DECODE) == []
    # Silent on, they are dead at dead_after.
    assert tick(reg, clock, 31.0)[1] == {"d1", "d2"}
    assert reg.suspicions == {"cleared": 2, "dead": 2}


def test_drain_does_not_revive_the_dead(reg, clock):
    register(reg, "d1")
    reg.mark_dead("d1")
    assert reg.drain("d1").state == WorkerState.DEAD
    assert reg.mark_dead("d1") is None  # already dead: not reported twice


def test_unregister_removes(reg):
    register(reg, "d1")
    assert reg.unregister("d1").id == "d1"
    assert reg.workers == {} and reg.unregister("d1") is None


def test_same_id_registering_again_replaces_its_entry(reg, clock):
    old, _ = register(reg, "d1")
    old.inflight = 4
    reg.mark_dead("d1")
    assert old.state == WorkerState.DEAD
    new, note = register(reg, "d1")
    assert note == "replaced" and new is not old and new.state == WorkerState.READY
    assert new.inflight == 0  # the dead entry's legs were failed, not carried over
    # A new session from the same connection: the worker dropped its legs before registering.
    new.inflight = 2
    again, note = register(reg, "d1", session="s2")
    assert note == "replaced" and again is not new and again.inflight == 0


def test_a_register_resent_before_its_ack_keeps_the_entry_and_its_legs(reg, clock):
    # A worker resends Register each beat until the ack arrives: on a loaded machine the ack
    # can be later than a beat, after legs were sent to it.
    first, _ = register(reg, "d1")
    first.inflight = 3
    clock.t += 1.0
    same, note = register(reg, "d1")
    assert note == "resent" and same is first and same.inflight == 3
    # The same session from another connection is another process: it replaces the entry.
    other, note = register(reg, "d1", identity=b"d1-elsewhere")
    assert note == "replaced" and other is not first and other.inflight == 0


def test_counts_and_snapshot(reg, clock):
    register(reg, "p1", Role.PREFILL)
    register(reg, "d1")
    register(reg, "d2")
    reg.drain("d2")
    reg.heartbeat("d1", Load(3, 1, 0.25), False)
    clock.t += 1.5
    assert reg.counts() == {("prefill", "ready"): 1, ("decode", "ready"): 1,
                            ("decode", "draining"): 1}
    snap = reg.snapshot()
    assert [s["id"] for s in snap] == ["d1", "d2", "p1"]
    d1 = snap[0]
    assert d1["role"] == "decode" and d1["state"] == "ready" and d1["address"] == "10.0.0.1"
    assert d1["model"] == "m" and d1["heartbeat_age_s"] == 1.5
    assert (d1["running"], d1["waiting"], d1["kv_usage"]) == (3, 1, 0.25)
