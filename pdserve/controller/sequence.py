"""One sequence of one request, from prompt to last token, across prefill and decode workers.

States: QUEUED (waiting for workers) -> PREFILL (prompt on a prefill worker) -> HANDOFF (decode
worker pulling the KV) -> DECODE (tokens streaming) -> DONE; or LOCAL (a decode worker does both,
for short prompts). A worker lost or timed out before the handoff retries the prefill elsewhere;
a decode worker lost mid-stream *migrates* the sequence: the prompt plus the tokens already
streamed are prefilled again and another decode worker continues, so the client sees each token
exactly once. An abort at any point frees the request on every worker that holds it, including
prefill-side blocks that no decode will read.

First token: the prefill worker samples the request's first token; it is streamed at once (or,
with `first_token="decode"`, together with the decode worker's first output). The decode worker
is then given the context plus that token, reads the KV of the context (no further: the
connector caps its read at what the prefill computed, kv/cpu_nixl.py), computes the token's
position and samples the next, so its first output is the stream's second token. Where the
engine must see the token as an output (stop strings, penalties, grammars, a token without its
whole text: `_extends`) it is given the same context instead, recomputes the last position and
draws it again, forced to the streamed token (`Generate.forced_tokens`, worker/first_token.py);
that copy is dropped, at the cost of one decode step. Nothing is seeded by pdserve: a
per-request generator kills a CPU engine when a chunked prefill's sample is discarded (vLLM
0.32). A request with its own seed is the exception: its prefill only computes the KV, and the
decode worker draws the first token with the request's generator, so seeded output equals one
engine's (TTFT then includes the handoff).
"""

from __future__ import annotations

import asyncio
import copy
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

from pdserve import protocol
from pdserve.controller.kvindex import block_keys
from pdserve.controller.phases import HandoffClock
from pdserve.controller.pool import Leg, Pool, WorkerLost
from pdserve.controller.receipts import Route, new_route
from pdserve.controller.registry import Worker, WorkerState
from pdserve.controller.resume import Resume, holdback
from pdserve.controller.router import Cached, Policy
from pdserve.controller.stream import Stream
from pdserve.errors import NoWorkerAvailable, RequestFailed, StepTimeout
from pdserve.protocol import KV_READ_STATS, ErrorKind, Phase, Role, SeqDelta

if TYPE_CHECKING:
    from pdserve.planner.placement import Placement

logger = logging.getLogger(__name__)


class State(str, enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    DECODE = "decode"
    LOCAL = "local"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class _Plan:
    """What one attempt of a sequence must do."""

    ctx: list[int]  # prompt + the tokens whose text the client has (_plan says when not)
    replay: list[int]  # tokens the client has, not in ctx: drawn again (forced)
    replay_text: str  # the text of those the client has: dropped from what they produce
    left: int  # tokens still to produce, replayed ones included
    min_left: int
    want_plp: bool  # prompt logprobs (first attempt only)


@dataclass
class Settings:
    prefill_policy: str = "least_loaded"
    decode_policy: str = "least_loaded"
    local_prefill_threshold: int = 0  # contexts shorter than this are prefilled by decode
    # A context the chosen decode worker's engine partly holds (the KV index says so), with
    # fewer than this many tokens left to compute, is prefilled there: the handoff is skipped.
    skip_handoff_below: int = 0
    queue_timeout: float = 60.0  # how long to wait for a worker of a needed role to appear
    # With no worker of a role in the pool (none ready, none suspect: all drained, restarting or
    # gone), a worker of the other role serves a request whole rather than the request waiting
    # for one (as one engine would).
    fallback: bool = True
    prefill_timeout: float = 300.0
    token_timeout: float = 60.0  # decode's first token (incl. the KV pull) and each later gap
    max_retries: int = 2  # failed legs (prefill retries + decode migrations) per sequence
    # "prefill": stream the prefill's token at once (lowest TTFT); "decode": hold it until the
    # decode worker's first token arrives (TTFT includes the handoff; no handoff gap in the
    # stream, so inter-token latency is the decode engine's alone).
    first_token: str = "prefill"
    # Admission (admission.py): sequences running at once, and waiting (up to queue_timeout)
    # for one of those slots; beyond that a request is refused with 429.
    max_inflight: int = 512
    max_queued: int = 1024


class WorkerFailed(Exception):
    """A worker reported an engine error for a leg (another worker may succeed)."""


class LegRefused(WorkerFailed):
    """A draining worker refused a leg before running it (another worker may take it)."""


class _NoneLeft(Exception):
    """Raised while waiting for a worker of one role (before a prefill, or before a handoff
    whose decode worker is gone) when the pool has none left and a worker of the other may
    serve the request whole (`Settings.fallback`): run() frees a prefill's KV not handed over
    and plans the attempt again, which then goes there. Never leaves run()."""


class _Aborted(Exception):
    """Raised inside a sequence that abort() ended while it was running; never leaves run()."""


# The route's reason when the fallback served a request whole, by the role the pool lacked.
NO_WORKER = {Role.PREFILL: "no_prefill_worker", Role.DECODE: "no_decode_worker"}
_ABORTED = object()  # put on a leg's queue to wake its reader when the sequence is aborted
_CHECK = object()  # put on a leg's queue by its reader's timer: time to check for a timeout


def own_draw(params) -> bool:
    """A seeded random request: its first token must come from its own generator, which only
    the decode worker may hold (see the module docstring)."""
    return params.seed is not None and params.temperature > 0


def kv_only_params(params, *, prompt_logprobs: bool) -> bytes:
    """A prefill whose token is not used: greedy, and always ended by length, so that the
    engine keeps the prompt's blocks for the decode worker (vLLM frees them on a stop)."""
    from vllm import SamplingParams

    p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                       prompt_logprobs=params.prompt_logprobs if prompt_logprobs else None,
                       skip_special_tokens=params.skip_special_tokens)
    return msgspec.msgpack.encode(p)


def leg_params(params, *, max_tokens: int, min_tokens: int, prompt_logprobs: bool) -> bytes:
    # A shallow copy, not SamplingParams.clone's deep one (two per request): only attributes
    # of the copy are set below, nothing they point to is changed.
    p = copy.copy(params)
    p.n = 1
    p.max_tokens = max_tokens
    p.min_tokens = min(min_tokens, max_tokens)
    if not prompt_logprobs:
        p.prompt_logprobs = None
    if p.extra_args:
        # Client-supplied KV-transfer parameters are never forwarded: only the controller may
        # point a decode worker at blocks, and only at blocks a prefill worker reported.
        p.extra_args = {k: v for k, v in p.extra_args.items() if k != "kv_transfer_params"} or None
    return msgspec.msgpack.encode(p)


class Sequence:
    """Drives one sequence (index `index` of a request) and feeds its tokens into `stream`."""

    def __init__(self, pool: Pool, prefill: Policy, decode: Policy, settings: Settings,
                 request_id: str, prompt: list[int], params, stream: Stream, index: int = 0,
                 observer: Observer | None = None, placer: Placer | None = None):
        self.pool = pool
        # `--placement slo`: where each attempt goes (planner/placement.py; a set
        # local_prefill_threshold then decides only local or not). None: the rules
        # (`_by_rules`: the decode policy, `_local_reason`, the prefill policy).
        self.placer = placer
        self.prefill_policy = prefill
        self.decode_policy = decode
        self.s = settings
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.stream = stream
        self.index = index
        self.state = State.QUEUED
        self.legs: list[Leg] = []
        self.pending_kv: tuple[dict, Worker] | None = None  # prefilled, not yet given to decode
        self.attempt = 0
        self.failures = 0
        self.obs: Observer = observer or _NoObserver()
        self._tag = uuid.uuid4().hex[:8]
        self.failed_on: set[str] = set()  # workers that failed this sequence: tried last
        self._streamed_text = ""  # text of the prefill's token, which decode reproduces
        self._given_logprob = 0.0  # of the prefill's token, when decode has it as context
        self._resume = Resume(holdback(params))  # where a migration may resume (resume.py)
        self.route: Route = new_route()  # where it went and why (receipts.py)
        self._keys: tuple[int, list[int]] | None = None  # (context length, its block keys)
        self._ctx: list[int] = prompt  # this attempt's context
        self._clock: HandoffClock | None = None  # the handoff in progress, for its phases
        self._reserved: Worker | None = None  # the decode worker counting this prefill's stream

    # ---- public ----------------------------------------------------------------------------

    async def run(self) -> AsyncIterator[None]:
        """Yield each time the stream has new output; raise a typed error if it cannot finish."""
        try:
            while not self._finished:
                try:
                    async for _ in self._attempt():
                        yield
                except _Aborted:
                    yield  # the stream now ends with finish_reason "abort", as vLLM's does
                    return
                except _NoneLeft:  # the pool lost a role while this attempt waited: plan again
                    self._release_pending()  # a prefill's KV no decode worker will read
                    continue
                except (WorkerLost, WorkerFailed, StepTimeout) as e:
                    self._release_pending()
                    self.failures += 1
                    if self.failures > self.s.max_retries:
                        self.state = State.FAILED
                        if isinstance(e, StepTimeout):
                            raise
                        raise RequestFailed(f"request {self.request_id} failed on "
                                            f"{self.failures} workers; last: {e}") from e
                    done = len(self.stream.tokens(self.index))
                    self.obs.retried(migrated=done > 0)
                    logger.warning("request %s: %s; %s after %d tokens (attempt %d)",
                                   self.request_id, e, "migrating" if done else "retrying",
                                   done, self.failures + 1)
            if self.state != State.ABORTED:
                self.state = State.DONE
                logger.info("request %s: %s", self.request_id, self.route.describe())
                self.obs.routed(self.route)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Free the sequence on every worker that holds part of it, and end its stream."""
        if self.state not in (State.DONE, State.FAILED, State.ABORTED):
            self.state = State.ABORTED
            self.stream.add(SeqDelta(self.index, "", [], finish_reason="abort"), self.index)
            self.pool.changed.set()  # wakes a run() that waits for a worker
        for leg in self.legs:
            self.pool.abort(leg)
            leg.queue.put_nowait(_ABORTED)  # wakes a run() that waits for this leg
        self.legs.clear()
        self._release_pending()

    def _check_aborted(self) -> None:
        """After every wait and every yield: an abort() may have happened meanwhile."""
        if self.state == State.ABORTED:
            raise _Aborted()

    # ---- steps -----------------------------------------------------------------------------

    @property
    def _finished(self) -> bool:
        return self.stream.seqs[self.index].finish_reason is not None

    def _leg_id(self, phase: str) -> str:
        # Unique even when clients reuse a request id, or two controllers share a worker: legs
        # are matched to outputs and aborted by this id.
        self.attempt += 1
        return f"{self.request_id}-{self.index}-{phase}{self.attempt}-{self._tag}"

    async def _choose(self, side: Role, policy: Policy, tokens: list[int],
                      ) -> tuple[Worker, int | None]:
        """A worker for `side`, and the tokens of `tokens` the KV index says it holds."""
        candidates = self._untried(await self._ready(side))
        if side == Role.DECODE:
            candidates = _with_slot(candidates)
        cached = self._cached(tokens, candidates) if policy.uses_cache else None
        w = policy.choose(candidates, tokens, cached)
        assert w is not None
        policy.routed(w, tokens)
        return w, (cached or {}).get(w.id)

    def _cached(self, tokens: list[int], workers: list[Worker]) -> Cached | None:
        kv = self.pool.kv
        if kv is None:
            return None
        return self.pool.cached_tokens(self._block_keys(tokens), len(tokens), workers)

    def _block_keys(self, tokens: list[int]) -> list[int]:
        # A context only grows (a migration adds the tokens streamed): its length names it.
        assert self.pool.kv is not None
        if self._keys is None or self._keys[0] != len(tokens):
            self._keys = (len(tokens), block_keys(tokens, self.pool.kv.block_size))
        return self._keys[1]

    def _correct(self, worker: Worker, tokens: list[int], said: int | None, had: int) -> None:
        """An engine held less than the index said (a removal it missed): tell the index."""
        kv = self.pool.kv
        if kv is not None and said is not None and had < said:
            bs = kv.block_size
            kv.correct(worker.id, self._block_keys(tokens)[:(len(tokens) - 1) // bs], had // bs)

    async def _ready(self, side: Role) -> list[Worker]:
        """The workers that may take work on a side, waiting up to the queue timeout for one."""
        deadline = time.monotonic() + self.s.queue_timeout
        while True:
            self._check_aborted()
            ready = self.pool.registry.ready(side)
            if ready:
                return ready
            if self._falls_back(side):
                raise _NoneLeft()
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoWorkerAvailable(side, self.s.queue_timeout)
            self.pool.changed.clear()
            try:
                async with asyncio.timeout(min(left, 0.5)):
                    await self.pool.changed.wait()
            except TimeoutError:
                pass

    async def _attempt(self) -> AsyncIterator[None]:
        a = self._plan()
        self.obs.queued()
        self._ctx = a.ctx
        # A seeded request keeps to the rules: they disaggregate it whenever they can (module
        # docstring), which the SLO's choice must not undo.
        if self._falls_back(Role.DECODE):
            d, p, reason = await self._whole_on_a_prefill_worker(a)
        elif self.placer is not None and not own_draw(self.params):
            d, p, reason = await self._placed(a)
        else:
            d, p, reason = await self._by_rules(a)
        if p is d:
            async for _ in self._local(a, d, reason):
                yield
            return
        self._reserve(d)
        try:
            async for _ in self._disaggregated(a, d, p, reason):
                yield
        finally:
            self._unreserve()

    async def _whole_on_a_prefill_worker(self, a: _Plan) -> tuple[Worker, Worker | None, str]:
        """No decode worker is left: a prefill worker serves the request whole, as one engine
        would (the prefill policy's choice; `_local` then runs it there)."""
        p, p_cached = await self._choose(Role.PREFILL, self.prefill_policy, a.ctx)
        self.route.placed(len(a.ctx), p.id, p_cached)
        return p, p, NO_WORKER[Role.DECODE]

    async def _by_rules(self, a: _Plan) -> tuple[Worker, Worker | None, str]:
        """(decode worker, prefill worker: itself when local, None to choose later, reason)."""
        # The decode worker first: what its engine holds decides whether a handoff pays.
        d, d_cached = await self._choose(Role.DECODE, self.decode_policy, a.ctx)
        self.route.placed(len(a.ctx), d.id, d_cached)
        reason = self._local_reason(a, d, d_cached)
        return d, (d if reason else None), reason

    async def _placed(self, a: _Plan) -> tuple[Worker, Worker | None, str]:
        """The SLO's choice (`--placement slo`): the same, from the placer's cost models."""
        assert self.placer is not None
        decoders = _with_slot(self._untried(await self._ready(Role.DECODE)))
        prefillers = self._untried(self.pool.registry.ready(Role.PREFILL))
        workers = {w.id: w for w in [*decoders, *prefillers]}
        cached = self._cached(a.ctx, list(workers.values())) or {}
        placed = self.placer.place(len(a.ctx), a.left, decoders, prefillers, cached,
                                   threshold=self.s.local_prefill_threshold or None)
        assert placed is not None  # there are decoders
        d, p = workers[placed.decode_worker], workers[placed.prefill_worker]
        self.route.placed(len(a.ctx), d.id, cached.get(d.id))
        # The policies that learn where prompts went keep learning.
        self.decode_policy.routed(d, a.ctx)
        if p is not d:
            self.prefill_policy.routed(p, a.ctx)
            self.route.prefill_cached = cached.get(p.id)
        logger.debug("request %s: %s (predicted TTFT %.0f ms, TPOT %.1f ms)", self.request_id,
                     placed.reason, placed.predicted_ttft * 1e3, placed.predicted_tpot * 1e3)
        return d, p, placed.reason

    def _untried(self, workers: list[Worker]) -> list[Worker]:
        """Those that have not failed this sequence, unless all have."""
        return [w for w in workers if w.id not in self.failed_on] or workers

    def _plan(self) -> _Plan:
        done = self.stream.tokens(self.index)
        # Tokens the client may not have the whole text of (held back by the detokenizer: part
        # of a UTF-8 character, or of a possible stop string) are drawn again, not put in the
        # context: their text would be lost, and a context ending inside a character makes
        # vLLM's detokenizer send the whole context as text (vllm-project/vllm#48853). All of
        # them are, when the sampler counts outputs: a grammar put back at its start, or
        # penalties forgetting what was said, would change the rest of the answer.
        keep, kept_text = (0, 0) if _counts_outputs(self.params) else self._resume.point()
        first_attempt = not done and self.failures == 0
        replay_text = self.stream.text(self.index)[kept_text:]
        self._streamed_text, self._given_logprob = replay_text, 0.0
        return _Plan(ctx=self.prompt + done[:keep], replay=list(done[keep:]),
                     replay_text=replay_text,
                     left=self.params.max_tokens - keep,
                     min_left=max(0, (self.params.min_tokens or 0) - keep),
                     want_plp=bool(self.params.prompt_logprobs) and first_attempt)

    def _local_reason(self, a: _Plan, d: Worker, d_cached: int | None) -> str:
        """Why the decode worker should prefill this context itself ("" if it should not):
        it is an auto worker whose duty is both (it serves requests whole), the context is
        short, or its engine holds all but a short part of it."""
        # A seeded request's local prefill may be chunked, which kills a CPU engine (module
        # docstring): it is disaggregated whenever a prefill worker can take it.
        if own_draw(self.params) and self.pool.registry.ready(Role.PREFILL):
            return ""
        if d.auto and d.duty == Role.BOTH:
            return "auto"
        if len(a.ctx) < self.s.local_prefill_threshold:
            return "short"
        if d_cached and len(a.ctx) - d_cached < self.s.skip_handoff_below:
            return "cached"
        if self._falls_back(Role.PREFILL):
            return NO_WORKER[Role.PREFILL]
        return ""

    def _falls_back(self, missing: Role) -> bool:
        """The pool has no worker for side `missing`, not even one late with its heartbeat, and
        one of the other side is ready to serve this request whole (not a seeded one: module
        docstring)."""
        other = Role.DECODE if missing == Role.PREFILL else Role.PREFILL
        return self._lacks(missing) and bool(self.pool.registry.ready(other))

    def _lacks(self, missing: Role) -> bool:
        """The fallback may act for this request (not a seeded one: module docstring), and the
        pool has no worker for side `missing`, not even one late with its heartbeat."""
        return (self.s.fallback and not own_draw(self.params)
                and not self.pool.registry.ready(missing, suspect=True))

    async def _local(self, a: _Plan, d: Worker, reason: str) -> AsyncIterator[None]:
        self.state = State.LOCAL
        self.route.path, self.route.reason = "local", reason
        self.obs.local(d.id)
        leg = self._send(d, Phase.LOCAL, a.ctx, leg_params(
            self.params, max_tokens=a.left, min_tokens=a.min_left, prompt_logprobs=a.want_plp),
            forced=a.replay, prefill_tokens=self._to_compute(a, self.route.decode_cached))
        async for _ in self._relay(leg, "local prefill", first_timeout=self.s.prefill_timeout,
                                   skip=a.replay):
            yield

    async def _disaggregated(self, a: _Plan, d: Worker, p: Worker | None,
                             reason: str = "") -> AsyncIterator[None]:
        """Prefill on `p` (the prefill policy's choice if None), stream (or hold) its token,
        hand the KV to decode worker `d`, relay it."""
        self.state = State.PREFILL
        self.route.path, self.route.reason = "disaggregated", reason
        if p is None:
            p, self.route.prefill_cached = await self._choose(Role.PREFILL,
                                                              self.prefill_policy, a.ctx)
        self.route.prefill = p.id
        first, kv, leg = await self._prefill(p, a)
        self._clock = HandoffClock(prefill_out=time.monotonic())
        if first is None:  # a seeded request: the decode worker draws the first token
            async for _ in self._handoff(a, d, leg, self._kv(kv, p), list(a.replay), a.ctx):
                yield
            return
        ends_here = first.finish_reason is not None and (first.finish_reason != "length"
                                                         or a.left <= 1)
        if not ends_here:
            first.finish_reason = first.stop_reason = None
        forced = list(first.token_ids) + a.replay[len(first.token_ids):]
        if a.replay:
            first = self._drop_seen(first, list(a.replay), leg)  # keep its text only
        if ends_here:
            self._emit(first)
            yield
            self._check_aborted()
            self._release_pending()
            return
        kv, ctx = self._kv(kv, p), a.ctx
        if _extends(a, first, kv, self.params):
            ctx, forced = a.ctx + first.token_ids, []
            self._given_logprob = first.cumulative_logprob or 0.0
        else:
            self._streamed_text = a.replay_text + first.text
        # The token goes out at once (with --first-token decode, with the decode worker's first
        # output), once the decode leg is on its way: the handoff does not wait for the chunk.
        held = first if self.s.first_token == "decode" else None
        async for _ in self._handoff(a, d, leg, kv, forced, ctx, held=held,
                                     now=None if held else first):
            yield

    def _kv(self, kv: dict | None, p: Worker) -> dict:
        if kv is None:
            raise WorkerFailed(f"prefill worker {p.id} returned no KV-transfer parameters")
        return kv

    async def _prefill(self, p: Worker, a: _Plan,
                       ) -> tuple[SeqDelta | None, dict | None, Leg]:
        """The prompt's KV on `p`; returns the token it drew (None when the decode worker draws
        the first token itself), the KV-transfer parameters naming the blocks, and the leg."""
        # A prefill with nothing ahead of it on its worker times the engine, not a queue.
        self.obs.prefill_started(p.id, alone=not (p.inflight or p.load.running or p.load.waiting))
        if own_draw(self.params):
            params, forced = kv_only_params(self.params, prompt_logprobs=a.want_plp), []
        else:
            params, forced = leg_params(self.params, max_tokens=1, min_tokens=min(1, a.min_left),
                                        prompt_logprobs=a.want_plp), a.replay[:1]
        leg = self._send(p, Phase.PREFILL, a.ctx, params, forced=forced,
                         prefill_tokens=self._to_compute(a, self.route.prefill_cached))
        outs = [o async for o in self._outputs(leg, "prefill", self.s.prefill_timeout,
                                               self.s.prefill_timeout)]
        kv = outs[-1].kv_transfer_params
        self.route.prefill_hit = outs[-1].num_cached_tokens or 0
        self._count_cached(self.route.prefill_hit)
        self._correct(p, a.ctx, self.route.prefill_cached, self.route.prefill_hit)
        if a.want_plp:
            self.stream.set_prompt_logprobs(next((o.prompt_logprobs for o in outs
                                                  if o.prompt_logprobs is not None), None))
        self.obs.prefill_done(len(a.ctx) - self.route.prefill_hit)
        if kv is not None:
            self.pending_kv = (kv, p)
            self._check_kv(kv, p)
        first = None if own_draw(self.params) else _merge([d for o in outs for d in o.seqs])
        return first, kv, leg

    async def _handoff(self, a: _Plan, d: Worker, prefill: Leg, kv: dict, forced: list[int],
                       ctx: list[int], held: SeqDelta | None = None,
                       now: SeqDelta | None = None) -> AsyncIterator[None]:
        """Decode worker `d` (another, if it is gone or refuses meanwhile) pulls the KV of `ctx`
        (the prefill's context, or that and its token), redraws `forced` (dropped here) and
        decodes on; with no decode worker left, the prefill worker goes on from its own cache
        (`_goes_on_at`). `now`, the prefill's token, is streamed as soon as the decode leg is
        sent (first, if another decode worker must be waited for); `held` goes out with its
        first output."""
        self.state = State.HANDOFF
        p = prefill.worker
        while True:
            if d not in self.pool.registry.ready(Role.DECODE):
                if now is not None:
                    self._emit(now)
                    yield
                    self._check_aborted()
                    now = None
                if self._goes_on_at(p):
                    async for _ in self._go_on(a, prefill, forced, ctx, held):
                        yield
                    return
                d, cached = await self._choose(Role.DECODE, self.decode_policy, a.ctx)
                self.route.decode, self.route.decode_cached = d.id, cached
            self._unreserve()  # the leg counts from here on
            given = len(ctx) - len(a.ctx)  # tokens already drawn that are context, not output
            leg = self._send(d, Phase.DECODE, ctx, leg_params(
                self.params, max_tokens=a.left - given, min_tokens=max(0, a.min_left - given),
                prompt_logprobs=False), kv_transfer_params=kv, forced=forced)
            leg.reads_from = p.id
            if self._clock is not None:
                self._clock.decode_sent = time.monotonic()
            self.pending_kv = None  # the decode worker now owns the handoff
            try:
                if now is not None:
                    self._emit(now)
                    yield
                    self._check_aborted()
                    now = None
                async for _ in self._relay(leg, "KV handoff", first_timeout=self.s.token_timeout,
                                           skip=forced, held=held, handed=prefill):
                    yield
                return
            except LegRefused:  # refused before it ran: the KV is still where it was
                self.pending_kv = (kv, p)  # for another decode worker, or run() releases it
                if d in self.pool.registry.ready(Role.DECODE):  # (so that this ends)
                    raise
            except (WorkerLost, WorkerFailed, StepTimeout):
                if not leg.outputs:  # it failed before pulling the KV (a dead engine): free it
                    self.pool.release_kv(kv, self._leg_id("r"), exclude=d.id)
                raise

    def _goes_on_at(self, p: Worker) -> bool:
        """No decode worker is left in the pool (none ready, none late with its heartbeat), and
        prefill worker `p`, which holds the context's KV, is still there, draining or not: it
        serves the rest of the request (not a seeded one: module docstring). A stop of every
        process at once (systemd's) leaves a request between its prefill and decode so."""
        return (self._lacks(Role.DECODE) and self.pool.registry.workers.get(p.id) is p
                and p.state in (WorkerState.READY, WorkerState.SUSPECT, WorkerState.DRAINING))

    async def _go_on(self, a: _Plan, prefill: Leg, forced: list[int], ctx: list[int],
                     held: SeqDelta | None) -> AsyncIterator[None]:
        """The rest of the request on the worker that prefilled it, as a local leg that goes
        on from that prefill: its context is in the engine's prefix cache, whose held blocks
        are then freed (after the leg, so that a draining worker still takes it)."""
        p = prefill.worker
        self._unreserve()
        self.state = State.LOCAL
        self.route.path, self.route.reason = "local", NO_WORKER[Role.DECODE]
        self.route.decode, self.route.decode_cached = p.id, None
        self._clock = None
        self.obs.local(p.id)
        given = len(ctx) - len(a.ctx)
        leg = self._send(p, Phase.LOCAL, ctx, leg_params(
            self.params, max_tokens=a.left - given, min_tokens=max(0, a.min_left - given),
            prompt_logprobs=False), forced=forced, continues=prefill.id)
        self._release_pending()
        async for _ in self._relay(leg, "local prefill", first_timeout=self.s.prefill_timeout,
                                   skip=forced, held=held):
            yield

    # ---- helpers ---------------------------------------------------------------------------

    def _send(self, worker: Worker, phase: Phase, tokens: list[int], params: bytes,
              kv_transfer_params: dict | None = None, forced: list[int] | None = None,
              prefill_tokens: int = 0, continues: str | None = None) -> Leg:
        msg = protocol.Generate(self._leg_id(phase.name.lower()[0]), phase, tokens,
                                msgspec.Raw(params), kv_transfer_params, forced or None,
                                continues)
        leg = self.pool.send(worker, msg, prefill_tokens)
        self.legs.append(leg)
        return leg

    async def _outputs(self, leg: Leg, step: str, first_timeout: float,
                       gap_timeout: float) -> AsyncIterator[protocol.Output]:
        loop = asyncio.get_running_loop()
        timeout, reason = first_timeout, None
        deadline = loop.time() + timeout
        # One timer per leg, not one per output: when it fires it wakes this reader, which
        # gives up only if no output came meanwhile (each moves the deadline on).
        watchdog = loop.call_at(deadline, leg.queue.put_nowait, _CHECK)
        try:
            while True:
                item = leg.queue.get_nowait() if not leg.queue.empty() else await leg.queue.get()
                if item is _CHECK:
                    if leg.prefill_tokens:  # still in its worker's prefill line: the line
                        deadline = max(deadline, leg.waits_since + timeout)  # moved since
                    if loop.time() < deadline:
                        watchdog = loop.call_at(deadline, leg.queue.put_nowait, _CHECK)
                        continue
                    self.pool.abort(leg)
                    raise StepTimeout(step, leg.worker.id, timeout)
                if item is _ABORTED:
                    raise _Aborted()
                if isinstance(item, WorkerLost):
                    raise item
                leg.backlog -= 1
                if item.error is not None:
                    if item.error_kind == ErrorKind.INVALID:
                        raise ValueError(item.error)
                    if item.error_kind == ErrorKind.DRAINING:
                        raise LegRefused(f"worker {leg.worker.id}: {item.error}")
                    if item.error_kind == ErrorKind.DEAD:  # nothing more runs there
                        self.pool.lost(leg.worker, f"its engine died ({item.error})")
                    raise WorkerFailed(f"worker {leg.worker.id}: {item.error}")
                for d in item.seqs:
                    if d.finish_reason:
                        reason = d.finish_reason
                        break
                if reason in ("error", "abort"):
                    # The engine gave up on the leg (a decode engine whose KV pull failed, an
                    # engine shutting down): never a whole answer; another worker may succeed.
                    raise WorkerFailed(f"worker {leg.worker.id}: the engine ended {leg.id} "
                                       f"with finish reason {reason!r}")
                if item.finished and reason is None:
                    raise WorkerFailed(f"worker {leg.worker.id}: {leg.id} finished without a "
                                       "finish reason")
                yield item
                if item.finished:
                    return
                step, timeout = "decode", gap_timeout
                deadline = loop.time() + timeout
                if deadline < watchdog.when():  # a shorter gap than the first wait
                    watchdog.cancel()
                    watchdog = loop.call_at(deadline, leg.queue.put_nowait, _CHECK)
        except (WorkerLost, WorkerFailed, StepTimeout) as e:
            # A read of KV on a worker that went away blames that worker, not the reader.
            self.failed_on.add(e.worker_id if isinstance(e, WorkerLost) else leg.worker.id)
            raise
        finally:
            watchdog.cancel()
            if leg in self.legs:
                self.legs.remove(leg)
            # Left before the leg ended (cancelled: the client went away): the worker must drop
            # it, as abort() can no longer find it in self.legs.
            self.pool.abort(leg)
            # A prefill's last output that arrived but was never read holds its blocks.
            while not leg.queue.empty():
                item = leg.queue.get_nowait()
                if isinstance(item, protocol.Output) and item.kv_transfer_params:
                    self.pool.release_kv(item.kv_transfer_params, f"{leg.id}-unread")

    async def _relay(self, leg: Leg, step: str, first_timeout: float,
                     skip: list[int] | None = None, held: SeqDelta | None = None,
                     handed: Leg | None = None) -> AsyncIterator[None]:
        """Feed a leg's tokens into the stream, first dropping `skip` (tokens already streamed,
        which the worker must reproduce); `held`, the prefill's token not yet streamed, goes out
        with the leg's first output, and `handed`, the prefill leg whose KV it read, is told
        so then (Pool.handed)."""
        skip = list(skip or [])
        first, unsaid = True, False
        async for out in self._outputs(leg, step, first_timeout, self.s.token_timeout):
            if handed is not None:
                self.pool.handed(handed)
                handed = None
            if out.timings is not None and self._clock is not None:
                self._clock.first_out, self._clock.timings = time.monotonic(), out.timings
            if out.kv_transfer_params and KV_READ_STATS in out.kv_transfer_params:
                self._kv_read(leg.worker, out.kv_transfer_params[KV_READ_STATS])
            elif self.route.path == "local" and out.num_cached_tokens is not None:
                self._count_cached(out.num_cached_tokens)
                self.route.decode_hit = out.num_cached_tokens
                self._correct(leg.worker, self._ctx, self.route.decode_cached,
                              out.num_cached_tokens)
            if out.prompt_logprobs is not None:
                self.stream.set_prompt_logprobs(out.prompt_logprobs)
            n, changed = 0, False
            if held is not None:
                self._add(held)
                n, changed, held = len(held.token_ids), True, None
            for d in out.seqs:
                if skip or self._streamed_text:
                    d = self._drop_seen(d, skip, leg)
                if self._given_logprob and d.cumulative_logprob is not None:
                    d.cumulative_logprob += self._given_logprob  # its sum omits the token
                self._add(d)
                n += len(d.token_ids)
                changed = changed or bool(d.token_ids or d.text or d.finish_reason)
            if n:
                if first:
                    self.obs.decode_started(leg.worker.id)
                    first = False
                self.obs.tokens(n)
            # Also a last delta without tokens: its finish reason must go out. Outputs of this
            # leg already waiting go out with it, in one chunk, as vLLM's output collector
            # merges what its server has not taken yet.
            unsaid = unsaid or changed
            if unsaid and not leg.backlog:
                unsaid = False
                yield
                self._check_aborted()

    @staticmethod
    def _to_compute(a: _Plan, cached: int | None) -> int:
        """Tokens of the context a worker computes, by the KV index's word (all if it cannot
        say): what the leg adds to the worker's prefill queue."""
        return max(1, len(a.ctx) - (cached or 0))

    def _count_cached(self, hit: int) -> None:
        """The usage's cached prompt tokens: those the engine that computed the prompt had in
        its prefix cache (the prefill engine's, or the local engine's), set once, before the
        first output (vLLM's streaming server reads it there). As vLLM's own P/D: the KV the
        decode engine was handed is not "cached", the prefill engine computed it."""
        if self.stream.num_cached_tokens is None:
            self.stream.num_cached_tokens = min(hit, len(self.prompt))

    def _kv_read(self, d: Worker, stats: list[int]) -> None:
        """The decode engine's report: tokens it had cached itself, tokens whose KV it read."""
        hit, read = int(stats[0]), int(stats[1])
        r = self.route
        r.decode_hit, r.kv_read_tokens = hit, read
        if len(stats) >= 5 and read:
            r.kv_read_in_step = bool(stats[4])
        r.kv_bytes = -(-read // d.info.block_size) * d.kv_block_bytes
        self._correct(d, self._ctx, r.decode_cached, hit)
        if self._clock is not None:
            phases = self._clock.phases((stats[2], stats[3]) if len(stats) >= 4 else None)
            if phases is not None:
                self.obs.handoff_phases(phases)
            self._clock = None

    def _reserve(self, d: Worker) -> None:
        """Count the stream on decode worker `d` while its prompt is prefilled elsewhere."""
        self.pool.reserve(d, 1)
        self._reserved = d

    def _unreserve(self) -> None:
        if self._reserved is not None:
            self.pool.reserve(self._reserved, -1)
            self._reserved = None

    def _emit(self, d: SeqDelta) -> None:
        """The prefill's token into the stream, for the caller's next yield."""
        self._add(d)
        self.obs.tokens(len(d.token_ids))

    def _add(self, d: SeqDelta) -> None:
        self.stream.add(d, self.index)
        self._resume.add(len(d.token_ids), d.text)

    def _drop_seen(self, d: SeqDelta, skip: list[int], leg: Leg) -> SeqDelta:
        k = 0
        while k < len(d.token_ids) and skip and d.token_ids[k] == skip[0]:
            skip.pop(0)
            k += 1
        if skip and k < len(d.token_ids):
            self.pool.abort(leg)
            raise WorkerFailed(f"decode worker {leg.worker.id} drew token {d.token_ids[k]} where "
                               f"the prefill drew {skip[0]}")
        # Drop the text the client already has. It may come later than its token: a detokenizer
        # holds text back while it could still begin a stop string.
        text, seen = d.text, self._streamed_text
        m = min(len(text), len(seen))
        if text[:m] == seen[:m]:
            text, self._streamed_text = text[m:], seen[m:]
        else:
            self._streamed_text = ""  # not a copy of what was streamed: keep it all
        if k == 0 and text == d.text:
            return d
        logprobs = d.logprobs[k:] if d.logprobs is not None else None
        return SeqDelta(d.index, text, d.token_ids[k:], logprobs, d.cumulative_logprob,
                        d.finish_reason, d.stop_reason)

    def _check_kv(self, kv: dict, p: Worker) -> None:
        # The parameters must point at the prefill worker that produced them, at its registered
        # side channel; anything else would let a bad peer aim a decode engine elsewhere.
        host, port = kv.get("remote_host"), kv.get("remote_port")
        if host is not None and (host != p.address or (p.kv_port and port != p.kv_port)):
            self._release_pending()
            self.failed_on.add(p.id)
            raise WorkerFailed(f"prefill worker {p.id} reported KV at {host}:{port}, "
                               f"not its registered {p.address}:{p.kv_port}")

    def _release_pending(self) -> None:
        """Free prefill-side blocks that no decode worker will read."""
        if self.pending_kv is None:
            return
        kv, p = self.pending_kv
        self.pending_kv = None
        if not self.pool.release_kv(kv, self._leg_id("r")):
            logger.warning("request %s: no decode worker to release %s's blocks yet; retried "
                           "when one is ready", self.request_id, p.id)


def _with_slot(decoders: list[Worker]) -> list[Worker]:
    """Decode workers whose engines can start the stream at once, if any: elsewhere it would
    wait for one of their streams to end (admission.py keeps the total within their slots,
    this spreads it)."""
    return [w for w in decoders if w.has_slot()] or decoders


def _extends(a: _Plan, first: SeqDelta, kv: dict, params) -> bool:
    """Whether the decode worker may take the prefill's token as context instead of drawing it
    again: it then computes only that token's position and samples the next one, a step sooner.
    Only when nothing the engine does depends on the token being an output (stop strings span
    outputs, penalties and grammars count them), when its text is whole (a context ending
    inside a character breaks vLLM's detokenizer), and when the prefill says how many tokens
    its KV covers (the decode connector reads no further: kv/cpu_nixl.py)."""
    return (not a.replay and len(first.token_ids) == 1 and bool(first.text)
            and kv.get("remote_num_tokens") == len(a.ctx)
            and not (params.stop or _counts_outputs(params)))


def _counts_outputs(params) -> bool:
    """Whether the engine's sampling depends on which tokens are outputs rather than context:
    presence and frequency penalties count outputs only, and a grammar or banned words
    follow them from the first (vLLM's repetition penalty counts both, and does not)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.bad_words
                or params.structured_outputs is not None)


def _merge(deltas: list[SeqDelta]) -> SeqDelta:
    """The prefill leg's deltas as one (usually there is exactly one)."""
    out = SeqDelta(0, "", [], None, None, None, None)
    for d in deltas:
        out.text += d.text
        out.token_ids += d.token_ids
        if d.logprobs is not None:
            out.logprobs = (out.logprobs or []) + d.logprobs
        out.cumulative_logprob = d.cumulative_logprob
        out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
    return out


class Placer(Protocol):
    """Where a request goes under `--placement slo` (controller/planning.py's Planning)."""

    def place(self, tokens: int, left: int, decoders: list[Worker], prefillers: list[Worker],
              cached: Cached | None = None, *, threshold: int | None = None,
              ) -> Placement | None: ...


class Observer(Protocol):
    """What a sequence reports as it goes (metrics.Timeline records it)."""

    def queued(self) -> None: ...
    def local(self, worker_id: str) -> None: ...
    def prefill_started(self, worker_id: str, alone: bool = False) -> None: ...
    def prefill_done(self, n_tokens: int) -> None: ...
    def decode_started(self, worker_id: str) -> None: ...
    def tokens(self, n: int) -> None: ...
    def retried(self, migrated: bool) -> None: ...
    def routed(self, route: Route) -> None: ...
    def handoff_phases(self, phases: dict[str, float]) -> None: ...


class _NoObserver:
    def queued(self) -> None:
        pass

    def local(self, worker_id: str) -> None:
        pass

    def prefill_started(self, worker_id: str, alone: bool = False) -> None:
        pass

    def prefill_done(self, n_tokens: int) -> None:
        pass

    def decode_started(self, worker_id: str) -> None:
        pass

    def tokens(self, n: int) -> None:
        pass

    def retried(self, migrated: bool) -> None:
        pass

    def routed(self, route: Route) -> None:
        pass

    def handoff_phases(self, phases: dict[str, float]) -> None:
        pass
