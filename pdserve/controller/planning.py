"""Duties for `--role auto` workers, from the live load: the role planner at work in a controller.

Every `interval` seconds a `Planning`:
1. smooths the demand this controller saw (request rate, prompt and output tokens);
2. feeds the cost models: each worker's decode steps (its heartbeat's `step_s`), and the
   prefill legs and handoffs this controller timed;
3. asks planner/roles.py's `RolePlanner` for a decision over the pool (auto and fixed workers);
4. applies its change, if any: the worker's duty, which is only what the router gives it from
   now on, so what it runs goes on untouched and no stream pauses. The change is logged with
   the predictions behind it and counted (`pdserve_role_changes_total{why}`).

It also exports the planner's desired workers per role (`pdserve_planner_desired_workers`), the
autoscaling signal, and, with `--placement slo`, places each request (`place`) from the same
cost models. Each controller plans for itself from what it sees; with several, each
sees its share of the requests (see docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from pdserve.controller.registry import Registry, Worker, WorkerState
from pdserve.planner.capacity import Demand
from pdserve.planner.costmodel import CostModel, Profile
from pdserve.planner.placement import Placement, Request, place
from pdserve.planner.placement import WorkerState as Placed
from pdserve.planner.roles import (ROLES, Decision, Memory, PoolView, PoolWorker, RolePlanner,
                                   Smoothed)
from pdserve.protocol import Load, Role

logger = logging.getLogger(__name__)

HALF_LIFE_S = 10.0  # of the demand signals: a shift shows within ~30 s; the hold rides out bursts
# Output tokens per request assumed until a request has finished here (a chat answer's order of
# size: the handoff's share of TPOT, predicted per output token, depends on it).
PRIOR_OUTPUT_TOKENS = 128.0
PLANNED = (WorkerState.READY, WorkerState.SUSPECT)  # the workers a split is planned over


class Planning:
    def __init__(self, registry: Registry, planner: RolePlanner, profile: Profile | None = None,
                 *, interval: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[Worker, str, str, str], None] = lambda *a: None):
        self.registry = registry
        self.planner = planner
        self.profile = profile or Profile()
        self.interval = interval
        self.clock = clock
        self.on_change = on_change
        # `--placement slo`: the longest pause a placement may put in a stream when another
        # option avoids it (planner/placement.py).
        self.max_stall_s: float | None = None
        self.pooled = CostModel(seed=self.profile)  # what the planner predicts with
        self.models: dict[str, CostModel] = {}  # each worker's own, for display
        self.memory = Memory()
        self.last: Decision | None = None
        self.desired: dict[str, int] = {}
        self._seen: dict[str, Load] = {}  # each worker's last load fed to the models
        self._rate, self._prompt, self._prompt_sq, self._out = (Smoothed(), Smoothed(),
                                                                Smoothed(), Smoothed())
        self._window = [0, 0, 0, 0, 0]  # since the last tick: requests, prompt, prompt^2, ends, out
        self._ticked: float | None = None

    # ---- what the controller reports (controller/metrics.py's Timeline) ---------------------

    def arrived(self, prompt_tokens: int) -> None:
        w = self._window
        w[0] += 1
        w[1] += prompt_tokens
        w[2] += prompt_tokens * prompt_tokens

    def finished(self, output_tokens: int) -> None:
        self._window[3] += 1
        self._window[4] += output_tokens

    def prefilled(self, worker_id: str, tokens: int, seconds: float) -> None:
        self.pooled.observe(tokens, seconds)
        self._model(worker_id).observe(tokens, seconds)

    def handed_over(self, worker_id: str, seconds: float) -> None:
        self.pooled.observe_handoff(seconds)
        self._model(worker_id).observe_handoff(seconds)

    # ---- one request's placement (`--placement slo`) -----------------------------------------

    def place(self, tokens: int, left: int, decoders: Sequence[Worker],
              prefillers: Sequence[Worker], cached: Mapping[str, int | None] | None = None, *,
              threshold: int | None = None) -> Placement | None:
        """Local or disaggregated, and on which workers, for a context of `tokens` with up to
        `left` tokens to generate, against the planner's SLO (planner/placement.py).

        Each worker is judged by its own cost model (the pooled one until it has its own), the
        streams it runs (its engine's last report, or this controller's legs on it and the
        streams it was chosen for that are still prefilling, if more: requests placed between
        two heartbeats must see each other) and the prompt tokens this controller queued on
        it to prefill. `cached`: tokens each engine holds (KV index).
        """
        out = max(1, min(left, round(self.demand().output_tokens)))
        uncached = {wid: tokens - c for wid, c in (cached or {}).items() if c}
        decodes = {w.id for w in decoders}
        prefills = {w.id for w in prefillers}
        states = [Placed(w.id, _side(w.id in prefills, w.id in decodes),
                         self.models.get(w.id, self.pooled),
                         queued_prefill_tokens=w.queued_prefill_tokens,
                         # A prefill worker's requests are prefills, not streams to stall.
                         running=(max(w.load.running, w.inflight + w.reserved)
                                  if w.id in decodes else 0))
                  for w in {w.id: w for w in [*decoders, *prefillers]}.values()]
        return place(Request(tokens, out, uncached), states, self.planner.slo,
                     local_prefill_threshold=threshold,
                     handoff_in_ttft=self.planner.handoff_in_ttft, max_stall_s=self.max_stall_s)

    # ---- the plan ---------------------------------------------------------------------------

    def tick(self) -> Decision | None:
        """One round: demand, costs, a decision, its change applied. None: no auto worker."""
        now = self.clock()
        self._smooth(now)
        # A suspect worker is late, not gone (controller/registry.py): it keeps its place in the
        # split, or every late heartbeat on busy cores would turn its peer into `both` and back.
        workers = [w for w in self.registry.workers.values() if w.state in PLANNED]
        for gone in set(self.models) - set(self.registry.workers):
            del self.models[gone]
            self._seen.pop(gone, None)
        self._observe_steps(workers)
        view = PoolView(tuple(PoolWorker(w.id, w.duty.label, w.auto, w.load.running)
                              for w in workers), self.demand(), self.pooled)
        # The autoscaling signal, whatever the roles: fixed-role pools scale on it too.
        self.desired = {r: self.planner.desired_workers(r, view) for r in ROLES}
        if not any(w.auto for w in workers):
            return None
        d = self.last = self.planner.decide(self.memory, view, now)
        self.memory = d.memory
        for c in d.changes:
            w = self.registry.workers.get(c.worker)
            if w is None:
                continue
            w.duty = Role[c.new.upper()]
            logger.info("worker %s: duty %s -> %s (%s: %s)", w.id, c.old, c.new, c.why, c.detail)
            self.on_change(w, c.old, c.new, c.why)
        return d

    def demand(self) -> Demand:
        prompt = self._prompt.value
        return Demand(self._rate.value, prompt, self._out.value or PRIOR_OUTPUT_TOKENS,
                      self._prompt_sq.value or prompt * prompt)

    async def run(self, changed: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                d = self.tick()
            except Exception:  # a planning bug must not stop the controller: duties stay
                logger.exception("role planning failed")
                continue
            if d is not None and d.changes:
                changed.set()  # requests waiting for a worker of some role look again

    def _smooth(self, now: float) -> None:
        dt = now - self._ticked if self._ticked is not None else self.interval
        self._ticked = now
        n, prompt, prompt_sq, ends, out = self._window
        self._window = [0, 0, 0, 0, 0]
        self._rate = self._rate.update(n / max(dt, 1e-9), now, HALF_LIFE_S)
        if n:
            self._prompt = self._prompt.update(prompt / n, now, HALF_LIFE_S)
            self._prompt_sq = self._prompt_sq.update(prompt_sq / n, now, HALF_LIFE_S)
        if ends:
            self._out = self._out.update(out / ends, now, HALF_LIFE_S)

    def _observe_steps(self, workers: list[Worker]) -> None:
        # Decode-only workers: a worker that also prefills has those stalls in its gaps, which
        # the capacity model charges apart (colocated prefill interference).
        for w in workers:
            load = w.load
            if w.duty != Role.DECODE or self._seen.get(w.id) is load or load.step_s <= 0:
                continue  # not a decoder, no new heartbeat, or no decode step in it
            self._seen[w.id] = load
            kv_tokens = 0  # not reported as tokens; the fit's KV term stays at its seed
            self.pooled.observe_step(round(load.step_running), kv_tokens, load.step_s)
            model = self._model(w.id)
            model.observe_step(round(load.step_running), kv_tokens, load.step_s)
            w.costs = model.snapshot()

    def _model(self, worker_id: str) -> CostModel:
        m = self.models.get(worker_id)
        if m is None:
            m = self.models[worker_id] = CostModel(seed=self.profile)
        return m


def _side(prefills: bool, decodes: bool) -> str:
    return "both" if prefills and decodes else "prefill" if prefills else "decode"
