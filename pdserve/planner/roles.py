"""Roles for `--role auto` workers: prefill, decode or both, chosen for the load (controller-side).

An auto worker's engine can do both (kv_both), so its assignment only changes what the router
sends it: streams it is decoding go on, and a change never pauses one. What makes a change
costly is churn, so the planner is slow on purpose:

    steady --(a better split exists)--> holding --(for hold_seconds)--> change one worker
       ^                                   |                                   |
       +---------(the wish lapses)---------+        (cooldown_seconds before the next)

Which split is better (capacity.py's predictions; `headroom` is the SLO slack kept in reserve):
- A split is *good* when it meets the SLO with `enter_headroom`. Among good splits the one with
  the fewest `both` workers wins (disaggregated streams are steadier than the means show: a long
  prefill stalls every stream on a colocated engine), then the most slack. So light or
  prefill-heavy load gets 1P1D-like splits, and `both` is what the pool turns to when the
  decode side saturates.
- The current split is kept while it meets the SLO with `stay_headroom` (< enter_headroom, so a
  load at the boundary does not flap), unless a good split has fewer `both` workers, or the same
  and `margin` more slack. When the current split misses, the best split is taken if it is good
  or its violation is `margin` smaller.
One decision moves at most one worker, the move (toward the target) whose result predicts best,
taking the worker of its role with the fewest streams. Decisions are pure functions of
(memory, view, now): tests drive them with a fake clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.planner import capacity
from pdserve.planner.capacity import Demand, Prediction, Slo, Split
from pdserve.planner.costmodel import Costs

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class PoolWorker:
    id: str
    role: str  # current assignment (for a fixed worker, its role)
    auto: bool = True  # fixed-role workers count in the split but never change
    running: int = 0  # streams it decodes now (the fewest go first)


@dataclass(frozen=True)
class PoolView:
    """What the controller knows when it asks: the workers, the smoothed demand, the costs (a
    Profile, or a CostModel fit over the pool)."""

    workers: tuple[PoolWorker, ...]
    demand: Demand
    costs: Costs = field(hash=False)

    def split(self) -> Split:
        return Split(*(sum(w.role == r for w in self.workers) for r in ROLES))


@dataclass(frozen=True)
class Memory:
    """The planner's state between decisions."""

    since: float | None = None  # when the current wish to change began (None: no wish)
    last_change: float = -math.inf


@dataclass(frozen=True)
class RoleChange:
    """A change to log and apply: `worker` goes from `old` to `new` because of `why` (a stable
    label: decode_saturated, prefill_saturated, steadier, rebalance, least_violation)."""

    worker: str
    old: str
    new: str
    why: str
    detail: str = ""  # the predictions behind it, for the log line


@dataclass(frozen=True)
class Decision:
    memory: Memory
    changes: tuple[RoleChange, ...]
    current: Prediction
    target: Prediction
    status: str  # steady, holding, cooldown, changed, stuck


@dataclass(frozen=True)
class Smoothed:
    """An exponentially weighted mean over time (half-life in seconds), for the load signals."""

    value: float = 0.0
    at: float | None = None

    def update(self, value: float, now: float, half_life: float) -> Smoothed:
        if self.at is None or half_life <= 0:
            return Smoothed(value, now)
        w = 1.0 - 0.5 ** (max(0.0, now - self.at) / half_life)
        return Smoothed(self.value + w * (value - self.value), now)


@dataclass(frozen=True)
class RolePlanner:
    slo: Slo
    hold_seconds: float = 30.0
    cooldown_seconds: float = 60.0
    enter_headroom: float = 0.15
    stay_headroom: float = 0.0
    margin: float = 0.1
    handoff_in_ttft: bool = False

    def predict(self, split: Split, view: PoolView) -> Prediction:
        return capacity.predict(split, view.demand, view.costs,
                                handoff_in_ttft=self.handoff_in_ttft)

    def candidates(self, view: PoolView) -> list[Split]:
        """Splits reachable by reassigning the auto workers: every P:D, every prefill + both and
        decode + both mix (O(auto workers): a 512-worker pool is planned in milliseconds)."""
        fixed = Split(*(sum(w.role == r and not w.auto for w in view.workers) for r in ROLES))
        n = sum(w.auto for w in view.workers)
        out = {view.split()}
        for x in range(n + 1):
            out.add(Split(fixed.prefill + x, fixed.decode + n - x, fixed.both))
            out.add(Split(fixed.prefill + x, fixed.decode, fixed.both + n - x))
            out.add(Split(fixed.prefill, fixed.decode + x, fixed.both + n - x))
        return sorted(out, key=lambda s: (s.both, s.prefill, s.decode))

    def good(self, p: Prediction) -> bool:
        return p.slack(self.slo) >= self.enter_headroom

    def target(self, view: PoolView) -> tuple[Prediction, Prediction]:
        """(the current split's prediction, the best split's)."""
        current = self.predict(view.split(), view)
        preds = [self.predict(s, view) for s in self.candidates(view)]
        good = [p for p in preds if self.good(p)]
        if good:
            fewest = min(p.split.both for p in good)
            best = max((p for p in good if p.split.both == fewest),
                       key=lambda p: (p.slack(self.slo), -_distance(p.split, current.split)))
            if (self.good(current) and current.split.both == best.split.both
                    and current.slack(self.slo) >= best.slack(self.slo) - self.margin):
                best = current
        else:
            best = min(preds, key=lambda p: (p.violation(self.slo),
                                             _distance(p.split, current.split)))
        return current, best

    def wish(self, current: Prediction, best: Prediction) -> str:
        """Why the pool should move from `current` toward `best` ("" when it should not)."""
        if best.split == current.split:
            return ""
        slack_now, slack_best = current.slack(self.slo), best.slack(self.slo)
        if slack_now < self.stay_headroom:
            if self.good(best) or best.violation(self.slo) < (
                    current.violation(self.slo) * (1.0 - self.margin)):
                return _shortage(current, self.slo) if self.good(best) else "least_violation"
            return ""
        if not self.good(best):
            return ""
        if best.split.both < current.split.both:
            return "steadier"
        if best.split.both == current.split.both and slack_best > slack_now + self.margin:
            return "rebalance"
        return ""

    def decide(self, memory: Memory, view: PoolView, now: float) -> Decision:
        current, best = self.target(view)
        why = self.wish(current, best)
        if not why:
            return Decision(Memory(None, memory.last_change), (), current, best, "steady")
        since = now if memory.since is None else memory.since
        held = Memory(since, memory.last_change)
        if now - since < self.hold_seconds:
            return Decision(held, (), current, best, "holding")
        if now - memory.last_change < self.cooldown_seconds:
            return Decision(held, (), current, best, "cooldown")
        change = self._step(view, current, best, why)
        if change is None:
            return Decision(held, (), current, best, "stuck")
        return Decision(Memory(None, now), (change,), current, best, "changed")

    def _step(self, view: PoolView, current: Prediction, best: Prediction,
              why: str) -> RoleChange | None:
        """One auto worker moved toward `best`: the move whose result predicts best."""
        now, goal = current.split, best.split
        moves = []
        for old in ROLES:
            for new in ROLES:
                if old == new or now.count(old) <= goal.count(old) \
                        or now.count(new) >= goal.count(new):
                    continue
                movable = [w for w in view.workers if w.auto and w.role == old]
                split = now.moved(old, new)
                if not movable or not _serves_both_sides(split):
                    continue
                after = self.predict(split, view)
                moves.append((after.violation(self.slo), -after.slack(self.slo), old, new,
                              min(movable, key=lambda w: (w.running, w.id)), after))
        if not moves:
            return None
        *_, old, new, worker, after = min(moves, key=lambda m: m[:4])
        detail = (f"{now.label()} -> {after.split.label()} (target {goal.label()}): predicted "
                  f"TTFT {_ms(current.ttft_s)} -> {_ms(after.ttft_s)} ms, TPOT "
                  f"{_ms(current.tpot_s)} -> {_ms(after.tpot_s)} ms")
        return RoleChange(worker.id, old, new, why, detail)

    def desired_workers(self, role: str, view: PoolView) -> int:
        """Workers of `role` this demand needs (for an autoscaler's metric): capacity.py's
        desired_workers with this planner's SLO and entry headroom."""
        return capacity.desired_workers(role, view.demand, view.costs, self.slo,
                                        headroom=self.enter_headroom,
                                        handoff_in_ttft=self.handoff_in_ttft)


def _serves_both_sides(s: Split) -> bool:
    return s.prefill + s.both > 0 and s.decode + s.both > 0


def _distance(a: Split, b: Split) -> int:
    return (abs(a.prefill - b.prefill) + abs(a.decode - b.decode) + abs(a.both - b.both)) // 2


def _shortage(current: Prediction, slo: Slo) -> str:
    """Which side of the current split misses the SLO (the change's label)."""
    ttft_over = current.ttft_s * 1e3 / slo.ttft_ms
    tpot_over = current.tpot_s * 1e3 / slo.tpot_ms
    return "decode_saturated" if tpot_over >= ttft_over else "prefill_saturated"


def _ms(s: float) -> str:
    return "inf" if s == math.inf else f"{s * 1e3:.1f}"
