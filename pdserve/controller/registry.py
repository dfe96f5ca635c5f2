"""Pool membership, kept by each controller: pure logic with an injectable clock.

A worker's life in the registry: register -> ready -> (draining) -> gone on unregister, or dead
after `missed` heartbeat intervals without a word. Dead entries stay visible for `forget_after`
seconds so that people can see what happened, then are dropped. A worker id that registers again
replaces its entry (a restarted worker, or one whose controller forgot it).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.protocol import EngineInfo, Load, Register, Role


class WorkerState(str, enum.Enum):
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


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
    load: Load = field(default_factory=Load)
    inflight: int = 0  # this controller's requests on the worker right now
    legs_total: int = 0  # request legs this controller has sent to the worker
    pid: int = 0

    def serves(self, side: str) -> bool:
        return self.role.serves_prefill() if side == "prefill" else self.role.serves_decode()

    def score(self) -> float:
        """Load as seen from here: the engine's last report plus what we sent since."""
        return self.load.running + self.load.waiting + self.inflight

    def as_json(self, now: float) -> dict:
        return {
            "id": self.id,
            "role": self.role.name.lower(),
            "state": self.state.value,
            "address": self.address,
            "kv_port": self.kv_port,
            "model": self.info.model,
            "block_size": self.info.block_size,
            "heartbeat_age_s": round(now - self.last_seen, 3),
            "running": self.load.running,
            "waiting": self.load.waiting,
            "kv_usage": round(self.load.kv_usage, 4),
            "inflight": self.inflight,
            "legs_total": self.legs_total,
            "pid": self.pid,
        }


class Registry:
    def __init__(self, expected: EngineInfo | None = None, *, heartbeat_interval: float = 1.0,
                 missed: int = 3, forget_after: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.expected = expected
        self.heartbeat_interval = heartbeat_interval
        self.missed = missed
        self.forget_after = forget_after
        self.clock = clock
        self.workers: dict[str, Worker] = {}

    def register(self, msg: Register, identity: bytes) -> tuple[Worker | None, str]:
        """Admit a worker, or refuse it with a reason that names the mismatch."""
        if self.expected is not None:
            wrong = self.expected.mismatches(msg.info)
            if wrong:
                return None, "engine settings do not match this pool: " + "; ".join(wrong)
        now = self.clock()
        old = self.workers.get(msg.worker_id)
        worker = Worker(msg.worker_id, Role(msg.role), msg.address, msg.kv_port, msg.info,
                        identity, registered_at=now, last_seen=now, pid=msg.pid)
        if old is not None and old.state != WorkerState.DEAD and old.identity == identity:
            worker.inflight = old.inflight  # same connection registering again: keep our count
        self.workers[msg.worker_id] = worker
        return worker, "replaced" if old is not None else ""

    def heartbeat(self, worker_id: str, load: Load, draining: bool) -> Worker | None:
        w = self.workers.get(worker_id)
        if w is None or w.state == WorkerState.DEAD:
            return None
        w.last_seen = self.clock()
        w.load = load
        if draining:
            w.state = WorkerState.DRAINING
        return w

    def drain(self, worker_id: str) -> Worker | None:
        w = self.workers.get(worker_id)
        if w is not None and w.state == WorkerState.READY:
            w.state = WorkerState.DRAINING
            w.last_seen = self.clock()
        return w

    def unregister(self, worker_id: str) -> Worker | None:
        return self.workers.pop(worker_id, None)

    def mark_dead(self, worker_id: str) -> Worker | None:
        w = self.workers.get(worker_id)
        if w is not None and w.state != WorkerState.DEAD:
            w.state = WorkerState.DEAD
            return w
        return None

    def expire(self) -> list[Worker]:
        """Mark silent workers dead, forget long-dead ones; return the newly dead."""
        now = self.clock()
        deadline = self.missed * self.heartbeat_interval
        newly_dead = []
        for w in list(self.workers.values()):
            silent = now - w.last_seen
            if w.state != WorkerState.DEAD and silent > deadline:
                w.state = WorkerState.DEAD
                newly_dead.append(w)
            elif w.state == WorkerState.DEAD and silent > self.forget_after:
                del self.workers[w.id]
        return newly_dead

    def by_identity(self, identity: bytes) -> Worker | None:
        for w in self.workers.values():
            if w.identity == identity:
                return w
        return None

    def ready(self, side: str) -> list[Worker]:
        """Workers that may be given new work on one side ("prefill" or "decode")."""
        return [w for w in self.workers.values()
                if w.state == WorkerState.READY and w.serves(side)]

    def counts(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for w in self.workers.values():
            key = (w.role.name.lower(), w.state.value)
            out[key] = out.get(key, 0) + 1
        return out

    def snapshot(self) -> list[dict]:
        now = self.clock()
        return [w.as_json(now) for w in sorted(self.workers.values(), key=lambda w: w.id)]
