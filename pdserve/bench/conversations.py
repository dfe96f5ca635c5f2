"""Sends a plan of conversations (chats.py) to `/v1/completions` and records every request as
vLLM's benchmark client does (TTFT, ITLs, E2E: metrics.py), plus its cached prompt tokens.

One conversation: wait for its start -> turn 1 = system + user token ids -> stream the reply,
whose token ids come back with `return_token_ids` -> think -> turn 2 = turn 1's prompt + reply +
new user token ids -> ... A failed turn ends its conversation: the later turns are recorded as
failed, unsent (their prompts need the reply).
Run as a child, as vLLM's client is (client.run_child):
`python -m pdserve.bench.conversations --plan P --base-url U --model M --result R`.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench import chats


def payload(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}


@dataclass
class Outcome:
    """One request, in the terms of vLLM's RequestFuncOutput; `reply`: the generated token ids
    (None when the server sent none)."""

    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0
    cached_tokens: int | None = None
    error: str = ""
    reply: list[int] | None = None


class Stream:
    """Reads one streamed completion: SSE bytes and their arrival times in, an Outcome out.
    A chunk with a choice is a token (TTFT for the first, an ITL for each later one), as in
    vLLM's client; the usage chunk gives prompt, completion and cached token counts."""

    def __init__(self, start: float, prompt_len: int):
        self.out = Outcome(prompt_len=prompt_len, start=start)
        self._buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._last = start
        self._chunks = 0
        self._ids: list[int] | None = None
        self._tokens: int | None = None
        self._done = False

    def feed(self, data: bytes, now: float) -> None:
        self._buffer += self._decoder.decode(data)
        while "\n\n" in self._buffer:
            message, self._buffer = self._buffer.split("\n\n", 1)
            for line in message.split("\n"):
                if line.startswith("data:"):
                    self._event(line[5:].strip(), now)

    def _event(self, data: str, now: float) -> None:
        if data == "[DONE]":
            self._done = True
            return
        e = json.loads(data)
        if "error" in e:
            err = e["error"]
            self.fail(str(err.get("message", err) if isinstance(err, dict) else err)[:300])
            return
        if choices := e.get("choices"):
            if self._chunks == 0:
                self.out.ttft = now - self.out.start
            else:
                self.out.itl.append(now - self._last)
            self._chunks += 1
            self._last = now
            if (ids := choices[0].get("token_ids")) is not None:
                self._ids = (self._ids or []) + list(ids)
        if usage := e.get("usage"):
            self._tokens = usage.get("completion_tokens")
            if usage.get("prompt_tokens") is not None:
                self.out.prompt_len = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                self.out.cached_tokens = int(details["cached_tokens"])

    def fail(self, error: str) -> None:
        self.out.error = self.out.error or error

    def finish(self) -> Outcome:
        out = self.out
        if not out.error and self._chunks == 0:
            out.error = "no token in the stream"
        elif not out.error and not self._done:
            out.error = "stream ended without [DONE]"
        out.latency = self._last - out.start
        out.reply = self._ids
        out.output_len = 0 if out.error else (
            self._tokens or (len(self._ids) if self._ids is not None else self._chunks))
        return out


async def send(session: Any, url: str, body: dict[str, Any], t0: float) -> Outcome:
    """POST one streamed completion; `start` in the Outcome is seconds after t0."""
    import aiohttp

    start = time.perf_counter()
    stream = Stream(start, len(body["prompt"]))
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                stream.fail(f"HTTP {r.status}: {(await r.text())[:300]}")
            else:
                async for data in r.content.iter_any():
                    stream.feed(data, time.perf_counter())
    except (aiohttp.ClientError, TimeoutError) as e:
        stream.fail(f"{type(e).__name__}: {e}"[:300])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        stream.fail(f"unreadable stream: {e!r}"[:300])
    out = stream.finish()
    out.start -= t0
    return out


async def converse(session: Any, url: str, model: str, plan: chats.Plan,
                   conv: chats.Conversation, vocab: list[int], t0: float,
                   results: dict[tuple[int, int], Outcome]) -> None:
    """One conversation, turn after turn; fills results[(conversation, turn)]."""
    await asyncio.sleep(max(0.0, t0 + conv.start - time.perf_counter()))
    history = chats.system_tokens(plan, conv, vocab)
    for k, turn in enumerate(conv.turns):
        if turn.think:
            await asyncio.sleep(turn.think)
        prompt = history + chats.user_tokens(plan, conv, k, vocab)
        out = await send(session, url, payload(model, prompt, turn.output_len), t0)
        results[(conv.index, k)] = out
        if k + 1 < len(conv.turns) and (out.error or out.reply is None):
            why = (f"turn {k + 1} failed" if out.error
                   else f"turn {k + 1} came back without token ids (return_token_ids)")
            for j in range(k + 1, len(conv.turns)):
                results[(conv.index, j)] = Outcome(error=f"not sent: {why}")
            return
        history = prompt + (out.reply or [])


async def run_plan(base_url: str, model: str, plan: chats.Plan, vocab: list[int],
                   timeout: float = 600.0) -> dict[str, Any]:
    """Every conversation of the plan, concurrently; the result JSON (result_json)."""
    import aiohttp

    convs = list(plan.conversations)
    results: dict[tuple[int, int], Outcome] = {}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(converse(session, base_url + "/v1/completions", model, plan, c,
                                        vocab, t0, results) for c in convs))
        duration = time.perf_counter() - t0
    keys = chats.requests(convs)
    return result_json([results[k] for k in keys], duration, keys)


def result_json(outcomes: list[Outcome], duration: float,
                keys: list[tuple[int, int]]) -> dict[str, Any]:
    """The shape of vLLM's client's detailed result (metrics.records_from_vllm reads it), plus
    `cached_tokens` and each request's conversation and turn. start_times count from the run's
    start (vLLM's are raw perf_counter readings)."""
    ok = [o for o in outcomes if not o.error]
    return {
        "duration": duration, "completed": len(ok), "failed": len(outcomes) - len(ok),
        "total_input_tokens": sum(o.prompt_len for o in ok),
        "total_output_tokens": sum(o.output_len for o in ok),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_lens": [o.prompt_len for o in outcomes],
        "output_lens": [o.output_len for o in outcomes],
        "ttfts": [o.ttft for o in outcomes],
        "itls": [o.itl for o in outcomes],
        "latencies": [o.latency for o in outcomes],
        "start_times": [o.start for o in outcomes],
        "errors": [o.error for o in outcomes],
        "cached_tokens": [o.cached_tokens for o in outcomes],
        "conversations": [c for c, _ in keys],
        "turns": [t for _, t in keys],
    }


def vocab_of(model: str) -> list[int]:
    """Token ids to draw prompts from: the tokenizer's, less its special ones (as vLLM's
    timed_trace dataset draws them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    special = set(tok.all_special_ids)
    return sorted({v for v in tok.get_vocab().values() if v not in special})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve.bench.conversations")
    p.add_argument("--plan", required=True, help="JSON of chats.Plan")
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--request-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    plan = chats.Plan.from_json(json.loads(Path(args.plan).read_text()))
    result = asyncio.run(run_plan(args.base_url, args.model, plan, vocab_of(args.model),
                                  args.request_timeout))
    Path(args.result).write_text(json.dumps(result) + "\n")
    print(f"{result['completed']} completed, {result['failed']} failed in "
          f"{result['duration']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
