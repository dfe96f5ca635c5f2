"""An in-process fake engine with vLLM's output shape, for control-plane tests and load.

`FakeEngine` implements the worker's `Engine` seam (pdserve/worker/engine.py) without a model:
the next token is a hash of the last few context tokens, so greedy output depends only on the
context. Prefill-then-decode on prompt + [t1] therefore equals one run on the prompt, and a
migrated request (prompt + tokens so far) continues exactly where it stopped. Seeded sampling
gives the greedy tokens too; unseeded random sampling (temperature > 0, no seed) draws at random,
so two engines disagree as real ones do unless the leg names its first tokens (forced tokens).

KV handoff, as NixlConnector does it: a prefill (`do_remote_decode`) that ends by length holds
its blocks and returns `kv_transfer_params`; a decode (`do_remote_prefill`) finds the prefill
engine in this process's registry of fake engines and reads (frees) them, and fails if they are
not there, which makes stranded or double-read KV visible. Held blocks are otherwise freed by
`release()` or after `hold_timeout`. A prefill engine in another process is not checked.

    python -m pdserve.fake worker --role decode --controller tcp://127.0.0.1:8001

runs a PDWorker around a FakeEngine in its own process (for kill -9 tests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import math
import random
import struct
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.engine.exceptions import EngineDeadError

from pdserve.fake_cache import FakePrefixCache
from pdserve.protocol import KV_READ_STATS, EngineInfo, Load, Role
from pdserve.worker.engine import FORCED_TOKENS_ARG, EngineProbe, expected_info
from pdserve.worker.kv_events import KvEventSource

logger = logging.getLogger(__name__)

VOCAB_SIZE = 512
EOS_TOKEN_ID = 2
WINDOW = 4  # context tokens the next token depends on
MODEL = "fake-model"
KV_BYTES_PER_TOKEN = 1024  # what a handoff of one token's KV would move

# Every live fake engine in this process, by engine id: where a decode engine reads KV from.
ENGINES: weakref.WeakValueDictionary[str, FakeEngine] = weakref.WeakValueDictionary()


def _hash(context: Sequence[int]) -> int:
    window = list(context[-WINDOW:])
    digest = hashlib.blake2b(struct.pack(f"<{len(window)}q", *window), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def next_token(context: Sequence[int], vocab_size: int = VOCAB_SIZE) -> int:
    return _hash(context) % vocab_size


def token_logprob(context: Sequence[int]) -> float:
    return -((_hash(context) >> 32) % 4000) / 1000 - 0.001


def token_text(token: int) -> str:
    return f" t{token}"


def part_of_a_character(token: int) -> bool:
    """With `split_characters`: a token whose text is sent with the next token's, as vLLM's
    detokenizer sends a byte that begins a UTF-8 character."""
    return token % 3 == 0


def fake_info(**overrides: Any) -> EngineInfo:
    fields: dict[str, Any] = {"model": MODEL, "tokenizer": MODEL, "block_size": 16,
                              "dtype": "float32", "kv_connector": "nixl", "max_model_len": 4096}
    fields.update(overrides)
    return EngineInfo(**fields)


@dataclass
class Completion:
    """One sequence's whole output, as one uninterrupted engine run produces it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0


class _Sampler:
    """The engine's per-sequence decisions, in vLLM's order (see v1/core/sched/utils.check_stop):
    eos and stop tokens end a sequence (min_tokens masks them until it is reached), then
    max_tokens, then stop strings (checked after min_tokens, on the text)."""

    def __init__(self, params, eos: int, vocab_size: int, split_characters: bool = False):
        self.p = params
        self.split = split_characters  # see FakeEngine
        own_eos = params.eos_token_id
        self.eos = None if params.ignore_eos else (eos if own_eos is None else own_eos)
        self.stops = set(params.stop_token_ids or ())
        self.vocab = vocab_size
        self.forced = list((params.extra_args or {}).get(FORCED_TOKENS_ARG) or ())
        # Unseeded random sampling draws differently on every engine, as a real one does.
        self.rng = random.Random() if params.temperature > 0 and params.seed is None else None
        self.out = Completion()
        self._emitted = 0  # characters of text already handed out
        self._holdback = 0 if params.include_stop_str_in_output else max(
            (len(x) - 1 for x in params.stop or ()), default=0)

    def step(self, context: list[int]) -> tuple[int, str]:
        """Sample one token after `context`; return it and the new text (a delta)."""
        out, p = self.out, self.p
        before = len(out.text)
        banned = self.stops | ({self.eos} if self.eos is not None else set())
        tok = self.rng.randrange(self.vocab) if self.rng else next_token(context, self.vocab)
        if len(out.token_ids) < len(self.forced):  # as worker/first_token.py makes vLLM do
            tok = self.forced[len(out.token_ids)]
        elif len(out.token_ids) < (p.min_tokens or 0):
            while tok in banned:
                tok = (tok + 1) % self.vocab
        out.token_ids.append(tok)
        out.cumulative_logprob += token_logprob(context)
        if tok == self.eos:
            out.finish_reason = "stop"
        elif tok in self.stops:
            out.finish_reason, out.stop_reason = "stop", tok
        else:
            out.text += token_text(tok)
            if p.max_tokens is not None and len(out.token_ids) >= p.max_tokens:
                out.finish_reason = "length"
            if len(out.token_ids) > (p.min_tokens or 0):
                for s in p.stop or ():
                    at = out.text.find(s, max(0, self._emitted - len(s)))
                    if at >= 0:
                        out.text = out.text[:at + len(s) if p.include_stop_str_in_output else at]
                        out.finish_reason, out.stop_reason = "stop", s
                        break
        # As vLLM's detokenizer, hold back text that may yet turn out to start a stop string.
        end = len(out.text) if out.finish_reason else max(self._emitted,
                                                          len(out.text) - self._holdback)
        if self.split and not out.finish_reason and part_of_a_character(tok):
            end = max(self._emitted, min(end, before))  # its text comes with the next token's
        delta = out.text[self._emitted:end]
        self._emitted = end
        return tok, delta


def reference(prompt: list[int], params, eos: int = EOS_TOKEN_ID,
              vocab_size: int = VOCAB_SIZE) -> Completion:
    """What one FakeEngine returns for the whole request (n=1)."""
    s = _Sampler(params, eos, vocab_size)
    context = list(prompt)
    while s.out.finish_reason is None:
        tok, _ = s.step(context)
        context.append(tok)
    return s.out


@dataclass
class _Hold:
    prompt: list[int]
    blocks: int
    deadline: float


class FakeEngineDead(EngineDeadError):
    """As vLLM's: every stream and health check of a dead engine raises it."""


class FakeEngine:
    """Implements pdserve.worker.engine.Engine in-process."""

    def __init__(self, *, info: EngineInfo | None = None, address: str = "127.0.0.1",
                 kv_port: int = 0, engine_id: str | None = None, num_blocks: int = 4096,
                 vocab_size: int = VOCAB_SIZE, eos_token_id: int = EOS_TOKEN_ID,
                 prefill_delay_per_token: float = 0.0, decode_delay: float = 0.0,
                 hold_timeout: float = 120.0, fail_after_tokens: int | None = None,
                 stall_after_tokens: int | None = None, kv_events: bool = True,
                 max_seqs: int = 0, last_output_delay: float = 0.0, kv_read_delay: float = 0.0,
                 prefill_in_turn: bool = False, split_characters: bool = False,
                 tokens_per_output: int = 1):
        self.info = info or fake_info()
        self.address = address
        self.kv_port = kv_port
        self.engine_id = engine_id or f"fake-{uuid.uuid4().hex[:12]}"
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.prefill_delay_per_token = prefill_delay_per_token
        self.decode_delay = decode_delay
        self.hold_timeout = hold_timeout
        # Failure injection: raise after this many output tokens of a request, or stop
        # producing (until aborted) after this many.
        self.fail_after_tokens = fail_after_tokens
        self.stall_after_tokens = stall_after_tokens
        # How long a finished request's last output takes to reach the worker (in vLLM, from
        # the engine core to the worker's output handler): an abort in between finds the
        # request finished, and a prefill's blocks already held.
        self.last_output_delay = last_output_delay
        # How long a decode request waits before its KV is read (a busy engine schedules it
        # steps later): the prefill engine must still hold the blocks then.
        self.kv_read_delay = kv_read_delay
        # Prefills one at a time, in the order they came (a busy engine's line), instead of
        # all at once.
        self._prefill_turn: contextlib.AbstractAsyncContextManager = (
            asyncio.Lock() if prefill_in_turn else contextlib.nullcontext())
        # Text as a real tokenizer's can come: some tokens' text only with the next token
        # (part_of_a_character); and outputs of several tokens, as vLLM's output collector
        # merges those its reader has not taken yet.
        self.split_characters = split_characters
        self.tokens_per_output = tokens_per_output
        # Cleared while the engine is frozen (its process stopped, as by SIGSTOP): nothing
        # steps, nor answers its worker's probe, and a read of its KV waits (its connection
        # stays up) until it is thawed.
        self.thawed = asyncio.Event()
        self.thawed.set()
        self._probe = EngineProbe(self.thawed.wait)
        self.dead = False
        self._held: dict[str, _Hold] = {}
        self._active: dict[str, int] = {}  # request id -> blocks in use
        self._aborted: set[str] = set()
        self.served: list[str] = []  # request ids that reached this engine, in order
        self.received: list[tuple[list[int], Any]] = []  # their (prompt, sampling params)
        self.kv_reads = 0
        self.kv_read_tokens = 0  # tokens whose KV this engine read from prefill engines
        self.cache = FakePrefixCache(self.info.block_size, num_blocks,
                                     salt=random.getrandbits(32))
        self.kv_events: KvEventSource | None = self.cache if kv_events else None
        self.kv_blocks = num_blocks
        self.kv_block_bytes = KV_BYTES_PER_TOKEN * self.info.block_size
        # As vLLM's --max-num-seqs (0: no limit): requests beyond it wait for a running one to
        # end before they are scheduled (and before a decode reads its KV).
        self.max_seqs = max_seqs
        self._slots = asyncio.Semaphore(max_seqs) if max_seqs else None
        self.waiting = 0
        self.waited = 0  # requests that found every slot taken
        ENGINES[self.engine_id] = self

    # ---- leak checks -----------------------------------------------------------------------

    def held_blocks(self) -> int:
        self._expire()
        return sum(h.blocks for h in self._held.values())

    def active_requests(self) -> list[str]:
        return list(self._active)

    # ---- Engine ----------------------------------------------------------------------------

    def _blocks(self, n_tokens: int) -> int:
        return -(-n_tokens // self.info.block_size)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, h in self._held.items() if h.deadline < now]:
            logger.warning("%s: held KV of %s expired unread", self.engine_id, rid)
            del self._held[rid]

    def _check_alive(self) -> None:
        if self.dead:
            raise FakeEngineDead(f"fake engine {self.engine_id} is dead")

    def _read_remote(self, prompt: list[int], kv: dict[str, Any]) -> int:
        """Pull the prompt's KV from the prefill engine; return the tokens it covers."""
        remote = ENGINES.get(kv.get("remote_engine_id", ""))
        if remote is None:  # another process: nothing to check
            return len(prompt) // self.info.block_size * self.info.block_size
        if remote.dead:
            raise RuntimeError(f"KV transfer failed: prefill engine {remote.engine_id} is dead")
        remote._expire()
        rid = kv.get("remote_request_id", "")
        hold = remote._held.pop(rid, None)
        if hold is None:
            raise RuntimeError(f"KV transfer failed: {remote.engine_id} holds no blocks for "
                               f"{rid} (never prefilled, already read or released)")
        if prompt[:len(hold.prompt)] != hold.prompt:
            raise RuntimeError(f"KV transfer failed: blocks of {rid} are another prompt's")
        self.kv_reads += 1
        return len(hold.prompt) // self.info.block_size * self.info.block_size

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params,
                       ) -> AsyncIterator[Any]:
        """Stream DELTA RequestOutputs, of `tokens_per_output` tokens each. Only n=1 (what
        PDWorker sends)."""
        from vllm.outputs import CompletionOutput, RequestOutput

        self._check_alive()
        p = sampling_params
        if (p.n or 1) != 1:
            raise ValueError("FakeEngine serves n=1 only")
        prompt = list(prompt_token_ids)
        if not prompt or len(prompt) >= self.info.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len "
                             f"{self.info.max_model_len}")
        if request_id in self._active:
            raise ValueError(f"request {request_id} is already running")
        kv_in = (p.extra_args or {}).get("kv_transfer_params") or {}
        if kv_in.get("do_remote_prefill") and self.kv_read_delay:
            await asyncio.sleep(self.kv_read_delay)
        if kv_in.get("do_remote_prefill") and (
                remote := ENGINES.get(kv_in.get("remote_engine_id", ""))) is not None:
            await remote.thawed.wait()
        await self.thawed.wait()
        await self._scheduled()
        try:
            remote_decode = bool(kv_in.get("do_remote_decode"))
            cached = local = self.cache.cached_tokens(prompt)
            read_stats = None
            if kv_in.get("do_remote_prefill"):
                # Once scheduled, before any other await, as vLLM admits it; only what the
                # local cache lacks moves.
                covered = self._read_remote(prompt, kv_in)
                read_stats = [local, max(0, covered - local)]
                self.kv_read_tokens += read_stats[1]
                cached = max(local, covered)
            self._expire()
            self._active[request_id] = self._blocks(len(prompt))
            self.served.append(request_id)
            self.received.append((prompt, p))
            sampler = _Sampler(p, self.eos_token_id, self.vocab_size, self.split_characters)
            merged: RequestOutput | None = None  # outputs not yet handed out
            context = list(prompt)
            async with self._prefill_turn:
                await asyncio.sleep(self.prefill_delay_per_token * (len(prompt) - cached))
            await self.thawed.wait()
            self._check_alive()
            self.cache.store(prompt)
            plp = _prompt_logprobs(prompt) if p.prompt_logprobs is not None else None
            while True:
                self._check_alive()
                if request_id in self._aborted:  # as vLLM: a last, empty output
                    yield RequestOutput(request_id, None, prompt, None, [CompletionOutput(
                        0, "", [], None, None, finish_reason="abort")], finished=True,
                        num_cached_tokens=cached)
                    return
                n = len(sampler.out.token_ids)
                if self.fail_after_tokens is not None and n >= self.fail_after_tokens:
                    raise RuntimeError(f"injected failure after {n} tokens")
                if self.stall_after_tokens is not None and n >= self.stall_after_tokens:
                    await asyncio.Event().wait()  # until cancelled
                tok, text = sampler.step(context)
                lps = None
                if p.logprobs is not None:
                    lps = [_top_logprobs(context, tok, p.logprobs, self.vocab_size)]
                context.append(tok)
                self._active[request_id] = self._blocks(len(context))
                done = sampler.out.finish_reason is not None
                kv_out = None
                if done and remote_decode and sampler.out.finish_reason == "length":
                    # As NixlConnector: only a length-capped prefill keeps its blocks.
                    self._held[request_id] = _Hold(prompt, self._blocks(len(prompt)),
                                                   time.monotonic() + self.hold_timeout)
                    kv_out = {"do_remote_prefill": True, "do_remote_decode": False,
                              "remote_engine_id": self.engine_id,
                              "remote_request_id": request_id,
                              "remote_host": self.address, "remote_port": self.kv_port,
                              "remote_block_ids": list(range(self._blocks(len(prompt)))),
                              "remote_num_tokens": len(prompt)}
                elif done and read_stats is not None and kv_in.get(KV_READ_STATS):
                    kv_out = {KV_READ_STATS: read_stats}
                if done and self.last_output_delay:
                    await asyncio.sleep(self.last_output_delay)
                out = CompletionOutput(
                    index=0, text=text, token_ids=[tok],
                    cumulative_logprob=sampler.out.cumulative_logprob if lps else None,
                    logprobs=lps, finish_reason=sampler.out.finish_reason,
                    stop_reason=sampler.out.stop_reason)
                ro = RequestOutput(request_id, None, prompt, plp, [out], finished=done,
                                   num_cached_tokens=cached, kv_transfer_params=kv_out)
                plp = None
                if merged is None:
                    merged = ro
                else:  # as vLLM's output collector merges what its reader has not taken
                    merged.add(ro, aggregate=True)
                if done or len(merged.outputs[0].token_ids) >= self.tokens_per_output:
                    yield merged
                    merged = None
                if done:
                    return
                await self._next_step()  # also lets aborts land
        finally:
            self._active.pop(request_id, None)
            self._aborted.discard(request_id)
            self._unscheduled()

    async def _scheduled(self) -> None:
        """Wait for one of the max_seqs slots (at once when there is no limit)."""
        if self._slots is None:
            return
        if self._slots.locked():
            self.waited += 1
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1

    def _unscheduled(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def _next_step(self) -> None:
        """Wait for the next decode step. As in an engine, one step advances every running
        request, so the streams' tokens come out together (steps on a shared grid)."""
        d = self.decode_delay
        if d <= 0:
            await asyncio.sleep(0)
        else:
            loop = asyncio.get_running_loop()
            await asyncio.sleep((math.floor(loop.time() / d) + 1) * d - loop.time())
        await self.thawed.wait()

    async def abort(self, request_ids: list[str]) -> None:
        # As vLLM: aborting a finished prefill does not free its held blocks.
        self._aborted.update(r for r in request_ids if r in self._active)

    async def release(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        remote = ENGINES.get(kv_transfer_params.get("remote_engine_id", ""))
        if remote is not None:
            remote._held.pop(kv_transfer_params.get("remote_request_id", ""), None)

    async def release_held(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._held.pop(rid, None)

    def load(self) -> Load:
        self._expire()
        used = sum(h.blocks for h in self._held.values()) + sum(self._active.values())
        return Load(running=len(self._active), waiting=self.waiting,
                    kv_usage=min(1.0, used / self.num_blocks))

    def unanswered(self) -> float:
        return self._probe.unanswered()

    async def check_health(self) -> None:
        self._check_alive()

    def die(self) -> None:
        """The engine fails: health checks and every stream raise from now on."""
        self.dead = True
        self._held.clear()

    def shutdown(self) -> None:
        self.die()
        ENGINES.pop(self.engine_id, None)


def _prompt_logprobs(prompt: list[int]):
    from vllm.logprobs import Logprob

    return [None] + [{tok: Logprob(token_logprob(prompt[:i]), 1, token_text(tok))}
                     for i, tok in enumerate(prompt) if i > 0]


def _top_logprobs(context: list[int], tok: int, k: int, vocab: int):
    """The sampled token with rank 1, then k other tokens with lower logprobs."""
    from vllm.logprobs import Logprob

    lp = token_logprob(context)
    out = {tok: Logprob(lp, 1, token_text(tok))}
    for i in range(k):
        other = (tok + 1 + i) % vocab
        out[other] = Logprob(lp - 1.0 - i, i + 2, token_text(other))
    return out


_ports = iter(range(30000, 60000))


def fake_worker(role: Role, controllers, *, worker_id: str | None = None,
                keys=None, heartbeat_interval: float = 1.0, drain_timeout: float = 30.0,
                discovery_interval: float | None = None, **engine_kwargs: Any):
    """A PDWorker around a new FakeEngine whose KV address matches the worker's registration."""
    from pdserve.worker.worker import PDWorker

    engine_kwargs.setdefault("kv_port", next(_ports))
    engine = FakeEngine(**engine_kwargs)
    return PDWorker(engine, role, controllers, worker_id=worker_id, address=engine.address,
                    kv_port=engine.kv_port, keys=keys, heartbeat_interval=heartbeat_interval,
                    drain_timeout=drain_timeout, discovery_interval=discovery_interval)


async def _run_worker(args) -> int:
    import vllm.outputs  # noqa: F401  # before registering: no request waits for this import

    from pdserve import transport
    from pdserve.worker.main import exit_code, stop_on_signals

    info = fake_info()
    if args.model:
        from vllm.engine.arg_utils import AsyncEngineArgs

        info = expected_info(AsyncEngineArgs(model=args.model, dtype="float32",
                                             enforce_eager=True).create_engine_config())
    keys = transport.Keys.load(args.keys) if args.keys else None
    from pdserve.worker.discovery import Discovery

    controllers = Discovery(args.controller, args.controllers_file)
    worker = fake_worker(Role[args.role.upper()], controllers, worker_id=args.worker_id,
                         keys=keys, heartbeat_interval=args.heartbeat_interval, info=info,
                         discovery_interval=args.discovery_interval,
                         drain_timeout=args.drain_timeout, decode_delay=args.decode_delay,
                         prefill_delay_per_token=args.prefill_delay_per_token,
                         max_seqs=args.max_seqs)
    stop_on_signals(worker)  # as a real worker: the first signal drains, a second stops
    try:
        await worker.run()
    finally:
        worker.engine.shutdown()
    return exit_code(worker)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.fake")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="a PDWorker around a FakeEngine")
    w.add_argument("--role", required=True, choices=[r.label for r in Role])
    w.add_argument("--controller", action="append", default=[])
    w.add_argument("--controllers-file", action="append", default=[])
    w.add_argument("--discovery-interval", type=float, default=None)
    w.add_argument("--worker-id", default=None)
    w.add_argument("--keys", default=None)
    w.add_argument("--model", default=None,
                   help="report the EngineInfo of a controller on this model folder")
    w.add_argument("--decode-delay", type=float, default=0.0)
    w.add_argument("--prefill-delay-per-token", type=float, default=0.0)
    w.add_argument("--max-seqs", type=int, default=0,
                   help="requests the engine runs at once, reported as vLLM's --max-num-seqs "
                        "(0: no limit, none reported)")
    w.add_argument("--heartbeat-interval", type=float, default=1.0)
    w.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds a draining worker waits for in-flight requests")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.cli import follow_serve
    from pdserve.worker.main import DRAIN_SIGNAL

    follow_serve(DRAIN_SIGNAL)  # as a real worker under `pdserve serve`
    return asyncio.run(_run_worker(args))


if __name__ == "__main__":
    raise SystemExit(main())
