"""pdserve's conversation runner against a fake `/v1/completions` (an aiohttp app defined here,
streaming as vLLM does), and the cache figures its results give. No engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pdserve.bench import chats, conversations, loads, report, scrape
from pdserve.bench.conversations import Stream
from pdserve.bench.metrics import Record, Slo, cache_summary, records_from_vllm, summarize

VOCAB = list(range(4, 2048))
BLOCK = 16


def sse(event: dict[str, Any] | str) -> bytes:
    text = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


class FakeCompletions:
    """Streams `max_tokens` tokens as vLLM does with return_token_ids and include_usage; its
    prefix cache holds every earlier prompt, in whole blocks."""

    def __init__(self, fail: set[int] | None = None, token_ids: bool = True):
        self.fail, self.token_ids = fail or set(), token_ids
        self.prompts: list[list[int]] = []
        self.bodies: list[dict[str, Any]] = []
        self.received: list[float] = []
        self.finished: dict[int, float] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        return app

    def cached(self, prompt: list[int]) -> int:
        def common(a: list[int], b: list[int]) -> int:
            return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

        best = max((common(prompt, p) for p in self.prompts), default=0)
        return min(best, len(prompt) - 1) // BLOCK * BLOCK

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        k, prompt = len(self.prompts), body["prompt"]
        cached = self.cached(prompt)
        self.prompts.append(prompt)
        self.bodies.append(body)
        self.received.append(time.perf_counter())
        if k in self.fail:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(0.002)
            choice: dict[str, Any] = {"index": 0, "text": "é",
                                      "finish_reason": "length" if i == n - 1 else None}
            if self.token_ids:
                choice["token_ids"] = [100 + (len(prompt) + i) % 1000]
            await resp.write(sse({"choices": [choice]}))
        await resp.write(sse({"choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
            "prompt_tokens_details": {"cached_tokens": cached}}}))
        await resp.write(sse("[DONE]"))
        self.finished[k] = time.perf_counter()
        return resp


@pytest.fixture
def serve() -> Iterator[Any]:
    """serve(fake) -> base URL; the app runs on an event loop in a thread of its own, so that
    both async tests and the runner's child process can reach it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners: list[web.AppRunner] = []

    def start(fake: FakeCompletions) -> str:
        async def go() -> str:
            runner = web.AppRunner(fake.app())
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            host, port = runner.addresses[0][:2]
            return f"http://{host}:{port}"

        return asyncio.run_coroutine_threadsafe(go(), loop).result(10)

    yield start
    for r in runners:
        asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def plan(*convs: chats.Conversation, run: int = 0) -> chats.Plan:
    return chats.Plan(0, run, convs)


def conv(index: int, *turns: tuple[int, int, float], start: float = 0.0,
         system: int = 32) -> chats.Conversation:
    return chats.Conversation(index, 0, system, start, tuple(chats.Turn(*t) for t in turns))


def test_the_request_is_one_vllms_completions_api_accepts() -> None:
    protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    r = protocol.CompletionRequest(**conversations.payload("m", [5, 6, 7], 4))
    assert (r.prompt, r.return_token_ids, r.stream, r.stream_options.include_usage) == (
        [5, 6, 7], True, True, True)
    params = r.to_sampling_params(4, None)
    assert (params.temperature, params.ignore_eos, params.max_tokens) == (0.0, True, 4)


# ---- the stream parser ---------------------------------------------------------------------


def test_stream_reads_timings_tokens_and_cached_tokens_across_split_reads() -> None:
    body = b"".join([
        sse({"choices": [{"text": "\u00e9", "token_ids": [7], "prompt_token_ids": [1, 2]}]}),
        sse({"choices": [{"text": "b", "token_ids": [8]}]}),
        sse({"choices": [{"text": "c", "token_ids": [9], "finish_reason": "length"}]}),
        sse({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
                                      "prompt_tokens_details": {"cached_tokens": 32}}}),
        sse("[DONE]")])
    s = Stream(start=10.0, prompt_len=2)
    cut = body.index(b"\xc3") + 1  # inside the UTF-8 of the first token's text
    reads = [(body[:cut], 10.5), (body[cut:body.index(b"data", cut)], 10.6),
             (body[body.index(b"data", cut):], 10.8)]
    for data, now in reads:
        s.feed(data, now)
    out = s.finish()
    assert (out.error, out.ttft, out.latency) == ("", pytest.approx(0.6), pytest.approx(0.8))
    assert out.itl == [pytest.approx(0.2), pytest.approx(0.0)]  # two tokens in one read
    assert (out.reply, out.output_len, out.prompt_len, out.cached_tokens) == ([7, 8, 9], 3, 40, 32)


def test_stream_errors() -> None:
    s = Stream(0.0, 5)
    s.feed(sse({"error": {"message": "worker lost", "code": 503}}), 1.0)
    assert s.finish().error == "worker lost"
    s = Stream(0.0, 5)
    s.feed(sse({"choices": [{"text": "a"}]}), 1.0)
    out = s.finish()
    assert out.error == "stream ended without [DONE]" and out.output_len == 0
    s = Stream(0.0, 5)
    s.feed(sse("[DONE]"), 1.0)
    assert s.finish().error == "no token in the stream"
    s = Stream(0.0, 5)
    s.feed(sse({"choices": [{"text": "a"}]}) + sse("[DONE]"), 1.0)
    out = s.finish()
    assert (out.error, out.reply, out.output_len, out.cached_tokens) == ("", None, 1, None)


# ---- the runner ----------------------------------------------------------------------------


async def test_turns_carry_the_conversation_and_wait_for_the_reply(serve: Any) -> None:
    fake = FakeCompletions()
    url = serve(fake)
    p = plan(conv(0, (20, 4, 0.0), (10, 5, 0.2), (12, 3, 0.1)),
             conv(1, (30, 4, 0.0), (8, 4, 0.05), start=0.05))
    result = await conversations.run_plan(url, "m", p, VOCAB)
    assert result["errors"] == [""] * 5
    assert (result["conversations"], result["turns"]) == ([0, 0, 0, 1, 1], [0, 1, 2, 0, 1])
    body = fake.bodies[0]
    assert (body["model"], body["temperature"], body["ignore_eos"], body["stream"],
            body["return_token_ids"], body["stream_options"]) == (
        "m", 0, True, True, True, {"include_usage": True})
    # Each turn's prompt: the previous prompt, its reply's token ids, the new user tokens.
    by_len = {len(pr): i for i, pr in enumerate(fake.prompts)}
    for c in p.conversations:
        prompts = [fake.prompts[by_len[n]] for n in chats.prompt_lens(c)]
        assert prompts[0] == (chats.system_tokens(p, c, VOCAB)
                              + chats.user_tokens(p, c, 0, VOCAB))
        for k in range(1, len(prompts)):
            reply = [100 + (len(prompts[k - 1]) + i) % 1000
                     for i in range(c.turns[k - 1].output_len)]
            assert prompts[k] == prompts[k - 1] + reply + chats.user_tokens(p, c, k, VOCAB)
    assert result["input_lens"] == [52, 66, 83, 62, 74]
    assert result["output_lens"] == [4, 5, 3, 4, 4]
    assert [len(i) for i in result["itls"]] == [3, 4, 2, 3, 3]
    assert all(t > 0 and lat >= t for t, lat in zip(result["ttfts"], result["latencies"]))
    # Cached: the shared system prompt (2 blocks) for another conversation's first turn, the
    # previous turn's prompt (whole blocks) for a later turn.
    assert result["cached_tokens"][3] == 32
    assert result["cached_tokens"][1] == 52 // BLOCK * BLOCK
    # Think time: turn k+1 leaves only after turn k's reply, plus its pause.
    assert fake.received[by_len[66]] - fake.finished[by_len[52]] >= 0.2
    assert fake.received[by_len[83]] - fake.finished[by_len[66]] >= 0.1
    assert result["start_times"][1] - result["start_times"][0] >= 0.2 + result["latencies"][0]
    assert result["start_times"][3] >= 0.05  # conversation 1 starts at 0.05 s
    assert result["duration"] >= max(s + lat for s, lat in zip(result["start_times"],
                                                              result["latencies"]))


async def test_a_failed_turn_ends_its_conversation(serve: Any) -> None:
    fake = FakeCompletions(fail={1})
    url = serve(fake)
    p = plan(conv(0, (20, 3, 0.0), (10, 3, 0.0), (10, 3, 0.0)))
    result = await conversations.run_plan(url, "m", p, VOCAB)
    assert len(fake.prompts) == 2  # the third turn was not sent
    assert result["errors"][0] == ""
    assert result["errors"][1].startswith("HTTP 500") and "boom" in result["errors"][1]
    assert result["errors"][2] == "not sent: turn 2 failed"
    assert (result["completed"], result["failed"]) == (1, 2)
    recs = records_from_vllm(result)
    assert [r.ok for r in recs] == [True, False, False]


async def test_without_token_ids_a_conversation_cannot_go_on(serve: Any) -> None:
    url = serve(FakeCompletions(token_ids=False))
    p = plan(conv(0, (20, 3, 0.0), (10, 3, 0.0)), conv(1, (20, 3, 0.0)))
    result = await conversations.run_plan(url, "m", p, VOCAB)
    assert result["errors"] == ["", "not sent: turn 1 came back without token ids "
                                "(return_token_ids)", ""]


async def test_an_unreachable_server_fails_every_request() -> None:
    from pdserve.net import free_port

    p = plan(conv(0, (20, 3, 0.0), (10, 3, 0.0)))
    result = await conversations.run_plan(f"http://127.0.0.1:{free_port()}", "m", p, VOCAB)
    assert "ClientConnectorError" in result["errors"][0]
    assert result["errors"][1] == "not sent: turn 1 failed"


# ---- figures and report --------------------------------------------------------------------


def test_cache_figures_from_the_runners_results() -> None:
    out = conversations.Outcome
    outcomes = [out(100, 4, 0.1, [0.01] * 3, 0.13, 0.0, 0), out(200, 4, 0.05, [0.01] * 3, 0.08,
                                                               1.0, 160),
                out(300, 4, 0.05, [0.01] * 3, 0.08, 2.0, None), out(error="boom")]
    result = conversations.result_json(outcomes, 4.0, [(0, 0), (0, 1), (1, 0), (1, 1)])
    recs = records_from_vllm(result)
    assert [r.cached_tokens for r in recs] == [0, 160, None, None]
    c = cache_summary(recs)
    # Only requests whose cached tokens are known count.
    assert c == {"requests": 2, "prompt_tokens": 300, "cached_tokens": 160,
                 "computed_tokens": 140, "hit_rate": pytest.approx(160 / 300)}
    s = summarize(recs, 4.0, Slo())
    assert s["cache"] == c and s["completed"] == 3
    assert "cache" not in summarize([Record(10, 2, 0.1, 0.2, [0.1])], 1.0, Slo())


def test_report_shows_the_cache_table_with_the_controllers_figures_unknown(tmp_path: Path) -> None:
    recs = [Record(1000, 4, 0.1, 0.13, [0.01] * 3, cached_tokens=0),
            Record(1200, 4, 0.05, 0.08, [0.01] * 3, cached_tokens=992)]
    run = {"rate": 1.0, "summary": summarize(recs, 2.0, Slo()),
           "controller_cache": scrape.cache_figures({})}
    results = {"meta": {}, "configs": {"1P1D": {"runs": [run]}}}
    report.write_report(results, {("1P1D", 1.0): recs}, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## Prefix cache" in md
    assert "| 1P1D | 1 | 2 | 2,200 | 992 | 1,208 | 45% |" in md
    row = next(x for x in md.splitlines() if x.startswith("| 1P1D | 1 | 2 | 2,200"))
    assert row.endswith("| - | - / - |")  # KV moved, per-side hit rates: not measured yet
    saved = json.loads((tmp_path / "results.json").read_text())["configs"]["1P1D"]["runs"][0]
    assert saved["controller_cache"] == dict.fromkeys(scrape.CACHE_FIGURES)
    assert saved["summary"]["cache"]["computed_tokens"] == 1208


def test_chat_load_runs_the_runner_as_a_child_and_measures(serve: Any, tmp_path: Path) -> None:
    from pdserve.models import ensure_model

    model = str(ensure_model("tiny"))  # only its tokenizer is read
    fake = FakeCompletions()
    url = serve(fake)
    spec = chats.ChatSpec("multiturn", (64, 64), (10, 20), 4, turns=(2, 3), think_s=0.01)
    load = loads.ChatLoad(spec, model, 1.0, token_seed=0)
    load.warm(url, 3, 0, tmp_path / "raw", "fake", tmp_path / "client.log")
    assert len(fake.prompts) == 3
    sent = load.measure(url, {}, 8, 20.0, 1, 0, tmp_path / "raw", "fake", tmp_path / "client.log")
    result = sent.run["result"]
    assert len(fake.prompts) == 3 + 8 and result["errors"] == [""] * 8
    assert sent.labels[0] == "turn1" and len(sent.labels) == 8
    assert sent.run["cpu"]["client"]["cpu_s"] > 0
    assert (tmp_path / "raw" / "fake-r20.json").exists()
    assert (tmp_path / "raw" / "plan-r20.json").exists()
    s = summarize(records_from_vllm(result, sent.labels), sent.run["duration"], Slo())
    assert s["completed"] == 8 and s["cache"]["cached_tokens"] > 0
    # The child drew prompts from the tiny model's tokenizer: ids 4-2047 (0-3 are special).
    assert all(4 <= t < 2048 for pr in fake.prompts for t in pr[:64])


def test_report_shows_the_controllers_cache_figures_when_the_client_has_none(
        tmp_path: Path) -> None:
    # Streamed P/D answers carry no usage.prompt_tokens_details: the controller's counters are
    # the figures, and the table must not vanish for want of the client's.
    recs = [Record(1000, 4, 0.1, 0.13, [0.01] * 3), Record(1200, 4, 0.05, 0.08, [0.01] * 3)]
    figures = dict.fromkeys(scrape.CACHE_FIGURES)
    figures.update(prompt_tokens_computed=640.0, kv_bytes_moved=2.5e6,
                   prefill_cache_hit_rate=0.71, decode_cache_hit_rate=0.83)
    run = {"rate": 1.0, "summary": summarize(recs, 2.0, Slo()), "controller_cache": figures}
    assert "cache" not in run["summary"]
    results = {"meta": {}, "configs": {"2P2D:kv": {"runs": [run]}}}
    report.write_report(results, {("2P2D:kv", 1.0): recs}, tmp_path)
    md = (tmp_path / "report.md").read_text()
    row = next(x for x in md.splitlines() if x.startswith("| 2P2D:kv | 1 | - | - | - | 640 | - |"))
    assert row.endswith("| 2.5 | 71% / 83% |")
