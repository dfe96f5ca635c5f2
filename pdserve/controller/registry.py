"""Pool membership, kept by each controller: pure logic with an injectable clock.

A worker's life in the registry: register -> ready -> (draining) -> gone on unregister. Silence
alone is suspicion, not a verdict: a worker on an overcommitted CPU can be alive and busy and
still late with its heartbeats.

- Any message from a worker (heartbeat, an Output of one of its legs, drain) is hearing from it.
- Silent for `missed` heartbeat intervals: `suspect`. It gets no new work, but its legs keep
  running, and the pool probes its connection (`Expiry.probe`). Heard from again: `ready`, and
  the suspicion is counted as cleared (a false one). A silent draining worker stays `draining`
  (it gets no new work anyway) and is probed the same way.
- Silent for `move_after` seconds: `stalled` (a process stopped or frozen, a paused container, an
  engine that no longer steps). Its legs move to other workers (the pool fails them there and
  aborts them, which it reads when it wakes); a role left with stalled workers only is missing,
  so the fallback serves its requests. A draining worker stalls the same way: the legs it was
  finishing would otherwise wait for it until `dead_after`. Heard from again: `ready` (or
  `draining`, for one that was), as a suspect.
- `dead` only on clear evidence: its connection is gone (a probe or a send fails: the pool calls
  `mark_dead`), or it was silent for `dead_after` seconds (a hung process, or a host that went
  away without closing its connections). Its legs are failed, and it must register again. An
  unregistered worker is gone at once.

A check that runs late means this controller itself was stalled: messages from that time may be
waiting unread, so the stall is not counted as the workers' silence. Dead entries stay visible
for `forget_after` seconds so that people can see what happened, then are dropped. A worker id
that registers again replaces its entry (a restarted worker, or one whose controller forgot it).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.protocol import EngineInfo, Load, Register, Role


class WorkerState(str, enum.Enum):
    READY = "ready"
    SUSPECT = "suspect"  # silent for `missed` intervals: no new work, its legs keep running
    STALLED = "stalled"  # silent for `move_after`: no new work, its legs moved elsewhere
    DRAINING = "draining"
    DEAD = "dead"


_SILENT = (WorkerState.SUSPECT, WorkerState.STALLED)  # what hearing from a worker ends


@dataclass
class Worker:
    id: str
    role: Role
    address: str
    kv_port: int
    info: EngineInfo
    identity: bytes  # ZMQ routing id
    registered_at: float
    last_seen: float
    state: WorkerState = WorkerState.READY
    draining: bool = False  # it said so: what it is again once a silence of its ends
    load: Load = field(default_factory=Load)
    inflight: int = 0  # this controller's requests on the worker right now
    # `inflight` when the engine's last load report came: the report counts those requests too.
    inflight_at_report: int = 0
    # Decode streams this controller has chosen it for whose prompts are still being prefilled
    # elsewhere: requests arriving together see each other's choice before any leg is sent.
    reserved: int = 0
    # Prompt tokens this controller sent it to prefill that have not produced output yet (its
    # prefill queue as seen from here: what `--placement slo` predicts a prefill's wait from).
    queued_prefill_tokens: int = 0
    legs_total: int = 0  # request legs this controller has sent to the worker
    pid: int = 0
    session: str = ""  # its registration's (protocol.Register)
    kv_events: bool = False  # its engine's prefix-cache events reach the pool's KV index
    kv_block_bytes: int = 0  # bytes of one KV block (0: unknown)
    max_seqs: int = 0  # requests its engine runs at once (0: unknown)
    reserves: bool = False  # it takes protocol.Reserved (this controller tells it `reserved`)
    # What it is given: its role, or for an AUTO worker what the planner assigned (it starts as
    # BOTH, serving requests whole, which is right for a worker alone).
    duty: Role = Role.BOTH
    costs: dict | None = None  # its cost model's snapshot (controller/planning.py), for display

    def __post_init__(self) -> None:
        if not self.auto:
            self.duty = self.role

    @property
    def auto(self) -> bool:
        return self.role == Role.AUTO

    def serves(self, side: Role) -> bool:
        return self.duty.serves(side)

    def score(self) -> float:
        """Load as seen from here: the requests of others in the engine's last report, ours
        now, and the decode legs we are about to send. Ours are counted from our own books, not
        the report, which is up to a heartbeat old: after a burst it still counted legs long
        finished, and a busy worker whose last report came before its stream began looked
        idler than workers that had finished theirs."""
        others = max(0, self.load.running + self.load.waiting - self.inflight_at_report)
        return others + self.inflight + self.reserved

    def free_slots(self) -> int:
        """Of its engine's max_seqs, those no other controller holds (as of its last heartbeat)."""
        return max(0, self.max_seqs - self.load.others)

    def has_slot(self) -> bool:
        """Its engine can start one more request now (as far as its load says)."""
        return not self.max_seqs or self.score() < self.max_seqs

    def as_json(self, now: float) -> dict:
        return {
            "id": self.id,
            "role": self.role.label,
            "state": self.state.value,
            "address": self.address,
            "kv_port": self.kv_port,
            "model": self.info.model,
            "block_size": self.info.block_size,
            "heartbeat_age_s": round(now - self.last_seen, 3),  # since any message
            "running": self.load.running,
            "waiting": self.load.waiting,
            "kv_usage": round(self.load.kv_usage, 4),
            "inflight": self.inflight,
            "reserved": self.reserved,
            "max_seqs": self.max_seqs,
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "legs_total": self.legs_total,
            "pid": self.pid,
            "duty": self.duty.label,
            **({"costs": self.costs} if self.costs is not None else {}),
        }


class Expiry(NamedTuple):
    """What one check found."""

    suspected: list[Worker]  # newly suspect
    dead: list[Worker]  # newly dead: silent for dead_after
    probe: list[Worker]  # silent (suspect, stalled, draining): is their connection there?
    stalled: list[Worker]  # newly stalled: silent for move_after


class Registry:
    def __init__(self, expected: EngineInfo | None = None, *, heartbeat_interval: float = 1.0,
                 missed: int = 3, move_after: float = 10.0, dead_after: float = 30.0,
                 forget_after: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.expected = expected
        self.heartbeat_interval = heartbeat_interval
        self.missed = missed
        self.move_after = move_after
        self.dead_after = dead_after
        self.forget_after = forget_after
        self.clock = clock
        self.workers: dict[str, Worker] = {}
        # How suspicions ended: "cleared" (the worker spoke again: a false suspicion) or "dead".
        self.suspicions = {"cleared": 0, "dead": 0}
        self._checked: float | None = None  # when expire() last ran

    def register(self, msg: Register, identity: bytes) -> tuple[Worker | None, str]:
        """Admit a worker, or refuse it with a reason that names the mismatch. The note says
        "replaced" for a worker that registers anew (its earlier legs are gone) and "resent"
        for a Register repeated before its ack arrived (the entry, and its legs, stand)."""
        if self.expected is not None:
            wrong = self.expected.mismatches(msg.info)
            if wrong:
                return None, "engine settings do not match this pool: " + "; ".join(wrong)
        now = self.clock()
        old = self.workers.get(msg.worker_id)
        if (old is not None and old.state != WorkerState.DEAD and old.identity == identity
                and msg.session and msg.session == old.session):
            return old, "resent"  # its ack was late: the same worker, its legs still running
        worker = Worker(msg.worker_id, Role(msg.role), msg.address, msg.kv_port, msg.info,
                        identity, registered_at=now, last_seen=now, pid=msg.pid,
                        kv_events=msg.kv_events, kv_block_bytes=msg.kv_block_bytes,
                        max_seqs=msg.max_seqs, session=msg.session, reserves=msg.reserves)
        if old is not None and old.auto and worker.auto:
            worker.duty = old.duty  # the planner's assignment stands
        self.workers[msg.worker_id] = worker
        return worker, "replaced" if old is not None else ""

    def heard(self, worker_id: str) -> bool:
        """The worker sent something, so it is alive. True if that cleared a suspicion."""
        w = self.workers.get(worker_id)
        if w is None or w.state == WorkerState.DEAD:
            return False  # a verdict stands: the worker must register again
        w.last_seen = self.clock()
        if w.state not in _SILENT:
            return False
        w.state = WorkerState.DRAINING if w.draining else WorkerState.READY
        self.suspicions["cleared"] += 1
        return True

    def heartbeat(self, worker_id: str, load: Load, draining: bool) -> Worker | None:
        w = self.workers.get(worker_id)
        if w is None or w.state == WorkerState.DEAD:
            return None
        self.heard(worker_id)
        w.load, w.inflight_at_report = load, w.inflight
        if draining:
            w.draining, w.state = True, WorkerState.DRAINING
        return w

    def drain(self, worker_id: str) -> Worker | None:
        w = self.workers.get(worker_id)
        self.heard(worker_id)
        if w is not None and w.state == WorkerState.READY:
            w.draining, w.state = True, WorkerState.DRAINING
        return w

    def unregister(self, worker_id: str) -> Worker | None:
        return self.workers.pop(worker_id, None)

    def mark_dead(self, worker_id: str) -> Worker | None:
        w = self.workers.get(worker_id)
        if w is not None and w.state != WorkerState.DEAD:
            if w.state in _SILENT:
                self.suspicions["dead"] += 1
            w.state = WorkerState.DEAD
            return w
        return None

    def expire(self) -> Expiry:
        """Suspect silent workers, stall longer-silent ones, declare long-silent ones dead,
        forget long-dead ones."""
        now = self.clock()
        # One check per half interval is the pool's pace; a longer gap is this controller's
        # own stall, not the workers' silence.
        stall = 0.0 if self._checked is None else max(
            0.0, now - self._checked - self.heartbeat_interval)
        self._checked = now
        suspect_after = self.missed * self.heartbeat_interval + stall
        found = Expiry([], [], [], [])
        for w in list(self.workers.values()):
            silent = now - w.last_seen
            if w.state == WorkerState.DEAD:
                if silent > self.forget_after:
                    del self.workers[w.id]
            elif silent > self.dead_after + stall:
                self.mark_dead(w.id)
                found.dead.append(w)
            elif silent > self.move_after + stall and w.state != WorkerState.STALLED:
                w.state = WorkerState.STALLED
                found.stalled.append(w)
                found.probe.append(w)
            elif silent > suspect_after:
                if w.state == WorkerState.READY:
                    w.state = WorkerState.SUSPECT
                    found.suspected.append(w)
                found.probe.append(w)
        return found

    def by_identity(self, identity: bytes) -> Worker | None:
        for w in self.workers.values():
            if w.identity == identity:
                return w
        return None

    def ready(self, side: Role, suspect: bool = False) -> list[Worker]:
        """Workers that may be given new work on one side (PREFILL or DECODE); with
        `suspect`, also those that may be again once heard from."""
        states = (WorkerState.READY, WorkerState.SUSPECT) if suspect else (WorkerState.READY,)
        return [w for w in self.workers.values() if w.state in states and w.serves(side)]

    def counts(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for w in self.workers.values():
            key = (w.role.label, w.state.value)
            out[key] = out.get(key, 0) + 1
        return out

    def snapshot(self) -> list[dict]:
        now = self.clock()
        return [w.as_json(now) for w in sorted(self.workers.values(), key=lambda w: w.id)]
