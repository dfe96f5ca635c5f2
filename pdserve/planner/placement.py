"""Where one request goes: prefilled and decoded on one worker ("local"), or prefilled on one and
decoded on another ("disaggregated"), chosen against the SLO from the workers' cost models.

For each option the request's TTFT and the TPOT it leaves behind are predicted:
- TTFT: the prefill worker's queue ahead (its queued prefill tokens, as one batch), this
  request's own prefill of the tokens that worker lacks (on a worker that is also decoding, each
  chunk of it rides with a decode step), and, for a handoff, its constant cost when the first
  token waits for the decode worker (`handoff_in_ttft`, the controller's `--first-token decode`).
- TPOT: the decode worker's step time with one more stream. A prefill on a worker that is
  decoding stalls its streams for the prefill's duration; for a stream of L tokens that is
  stall / (L-1) more TPOT (L: the expected output, the only length known). Streams on a `both`
  worker used as the prefill side of a handoff are stalled the same way. With the first token
  from the prefill, the handoff gap is this request's own: handoff / (out-1).
The option that meets both SLO terms with the most slack (on the binding term, then on the
other) wins (`slo_local`, `slo_disagg`); when none meets it, the least violation
(`least_violation`). With `max_stall_s`, an option that would pause a stream for longer than that
(`Placement.stall_s`) is taken only when every option would: TPOT is a mean, and a long prompt
prefilled on a decode worker can meet it while every stream there, or handed to it meanwhile,
waits for the whole prefill: the pause P/D exists to avoid. `local_prefill_threshold`, when set,
wins over all that (`manual_threshold`): prompts under it go local, the rest disaggregated.

Cost: O(workers log workers): every local option, and handoffs between the `shortlist` best prefill
candidates and the `shortlist` best decode candidates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.planner.capacity import Slo
from pdserve.planner.costmodel import Costs

__all__ = ["Placement", "Request", "Slo", "WorkerState", "place"]

LOCAL, DISAGG = "local", "disaggregated"
CHUNK_TOKENS = 2048  # vLLM's max_num_batched_tokens on the CPU build


@dataclass(frozen=True)
class WorkerState:
    """What the controller's registry knows of one ready worker, for one decision."""

    id: str
    role: str  # its assignment: "prefill", "decode" or "both"
    costs: Costs
    queued_prefill_tokens: int = 0  # prompt tokens sent to it and not yet prefilled
    running: int = 0  # streams it is decoding
    kv_tokens: int = 0  # tokens of KV those streams hold

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    output_tokens: int  # expected (max_tokens, or a guess from the workload)
    # worker id -> prompt tokens that worker's cache lacks (absent: all of them)
    uncached: Mapping[str, int] = field(default_factory=dict, hash=False)

    def new_tokens(self, worker_id: str) -> int:
        return max(1, self.uncached.get(worker_id, self.prompt_tokens))


@dataclass(frozen=True)
class Placement:
    kind: str  # "local" or "disaggregated"
    prefill_worker: str  # == decode_worker when local
    decode_worker: str
    predicted_ttft: float  # seconds
    predicted_tpot: float  # seconds
    reason: str  # a stable metric label: slo_local, slo_disagg, least_violation, manual_threshold
    # The longest pause it puts in a stream: a local prefill pauses every stream on its worker
    # (those there now and those handed to it meanwhile); a handoff from a `both` worker pauses
    # that worker's streams, and the new stream waits for its decode worker's queued prefills.
    stall_s: float = 0.0


def _queue_s(w: WorkerState) -> float:
    return w.costs.prefill_seconds(w.queued_prefill_tokens) if w.queued_prefill_tokens else 0.0


def _prefill_s(w: WorkerState, n: int, chunk_tokens: int) -> float:
    """This prefill on `w`, including the decode steps its chunks share when `w` is decoding."""
    own = w.costs.prefill_seconds(n)
    if w.running:
        own += math.ceil(n / chunk_tokens) * w.costs.step_seconds(w.running, w.kv_tokens)
    return own


@dataclass(frozen=True)
class _Ctx:
    req: Request
    handoff_in_ttft: bool
    chunk_tokens: int

    @property
    def gaps(self) -> int:
        return max(1, self.req.output_tokens - 1)

    def step_with_one_more(self, d: WorkerState) -> float:
        kv = d.kv_tokens + self.req.prompt_tokens + self.req.output_tokens // 2
        return d.costs.step_seconds(d.running + 1, kv)

    def local(self, w: WorkerState) -> Placement:
        own = _prefill_s(w, self.req.new_tokens(w.id), self.chunk_tokens)
        queue = _queue_s(w)
        step = self.step_with_one_more(w)
        # Its own stream starts after its prefill; the streams already there wait for the
        # queued prefills and this one.
        stall = queue + own if w.running else 0.0
        # The pause counts even with no stream there now: one handed to it meanwhile waits too.
        return Placement(LOCAL, w.id, w.id, queue + own, step + stall / self.gaps, "",
                         queue + own)

    def disagg(self, p: WorkerState, d: WorkerState) -> Placement:
        own = _prefill_s(p, self.req.new_tokens(p.id), self.chunk_tokens)
        handoff = d.costs.handoff_s
        ttft = _queue_s(p) + own + (handoff if self.handoff_in_ttft else 0.0)
        step = self.step_with_one_more(d)
        # Local prefills queued on the decode worker stall every stream there, this one too.
        tpot = step + _queue_s(d) / self.gaps
        if not self.handoff_in_ttft:
            tpot += handoff / self.gaps
        stall = own if p.running else 0.0  # a `both` worker's streams wait for this prefill
        if stall:
            tpot = max(tpot, p.costs.step_seconds(p.running, p.kv_tokens) + stall / self.gaps)
        # This stream's own pause after its first token: the decode worker's queued prefills.
        return Placement(DISAGG, p.id, d.id, ttft, tpot, "", max(stall, _queue_s(d)))


def place(req: Request, workers: Sequence[WorkerState], slo: Slo, *,
          local_prefill_threshold: int | None = None, handoff_in_ttft: bool = False,
          chunk_tokens: int = CHUNK_TOKENS, shortlist: int = 4,
          max_stall_s: float | None = None) -> Placement | None:
    """The placement for `req` among `workers` (None when no worker can decode)."""
    ctx = _Ctx(req, handoff_in_ttft, chunk_tokens)
    decoders = sorted((w for w in workers if w.decodes), key=lambda w: w.id)
    prefillers = sorted((w for w in workers if w.prefills), key=lambda w: w.id)
    if not decoders:
        return None
    if local_prefill_threshold is not None:
        return _manual(ctx, prefillers, decoders, slo, local_prefill_threshold, shortlist)
    options = [ctx.local(w) for w in decoders] + _handoffs(ctx, prefillers, decoders, shortlist)
    if max_stall_s is not None:
        options = [o for o in options if o.stall_s <= max_stall_s] or options
    return _choose(options, slo)


def _handoffs(ctx: _Ctx, prefillers: list[WorkerState], decoders: list[WorkerState],
              shortlist: int) -> list[Placement]:
    """A handoff's TTFT depends only on its prefill side and its TPOT mostly on its decode side:
    pair the best few of each instead of trying all pairs."""
    n = ctx.req.new_tokens
    best_p = sorted(prefillers, key=lambda p: (
        _queue_s(p) + _prefill_s(p, n(p.id), ctx.chunk_tokens), p.id))[:shortlist]
    best_d = sorted(decoders, key=lambda d: (
        ctx.step_with_one_more(d) + _queue_s(d) / ctx.gaps, d.id))[:shortlist]
    return [ctx.disagg(p, d) for p in best_p for d in best_d if p.id != d.id]


def _choose(options: list[Placement], slo: Slo) -> Placement:
    meeting = [o for o in options if slo.meets(o.predicted_ttft, o.predicted_tpot)]
    if meeting:
        # Most slack (binding term first, then the other); on a tie a handoff (the steadier
        # streams), then the smallest worker ids.
        best = min(meeting, key=lambda o: (
            tuple(-x for x in slo.slacks(o.predicted_ttft, o.predicted_tpot)),
            o.kind != DISAGG, o.prefill_worker, o.decode_worker))
        return _with(best, "slo_local" if best.kind == LOCAL else "slo_disagg")
    best = min(options, key=lambda o: (slo.violation(o.predicted_ttft, o.predicted_tpot),
                                       o.kind != DISAGG, o.prefill_worker, o.decode_worker))
    return _with(best, "least_violation")


def _manual(ctx: _Ctx, prefillers: list[WorkerState], decoders: list[WorkerState], slo: Slo,
            threshold: int, shortlist: int) -> Placement:
    """The operator's threshold decides the kind; the model still picks the workers."""
    options: list[Placement] = []
    if ctx.req.prompt_tokens >= threshold:
        options = _handoffs(ctx, prefillers, decoders, shortlist)
    if not options:  # under the threshold, or no pair of distinct workers
        options = [ctx.local(w) for w in decoders]
    best = min(options, key=lambda o: (slo.violation(o.predicted_ttft, o.predicted_tpot),
                                       -slo.slack(o.predicted_ttft, o.predicted_tpot),
                                       o.prefill_worker, o.decode_worker))
    return _with(best, "manual_threshold")


def _with(p: Placement, reason: str) -> Placement:
    return dataclasses.replace(p, reason=reason)
