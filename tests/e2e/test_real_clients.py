"""Real clients' defaults against the 1P1D `pd_server`: random sampling without a seed (what
most clients send), seeded sampling, n = 2, chat and completions, streaming and not, prompts
long enough to be chunk-prefilled, many at once; and vLLM's own benchmark client with its
defaults. No engine may die (it used to: a seed pdserve added to every request killed the CPU
prefill engine at its first discarded partial-prefill sample), no request may fail or end short.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import openai
from procs import get_json, metric
from test_openai import prompt_ids

WORDS = ("alpha beta gamma delta kernel import return class while yield lambda self data "
         "value index count total error result").split()
LENGTHS = (150, 400, 900, 1500)  # words; the longer ones span several prefill chunks
REQUESTS, CONCURRENCY = 96, 16


def pool_pids(base: str) -> dict[str, int]:
    return {w["id"]: w["pid"] for w in get_json(base + "/pd/workers") if w["state"] == "ready"}


def case(i: int, rng: random.Random) -> dict:
    """Request i: chat or completion, streamed or not, unseeded, seeded or greedy, n 1 or 2."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.choice(LENGTHS)))
    kw: dict = {"max_tokens": rng.choice((16, 48, 96))}
    if i % 3 == 1:
        kw.update(seed=i, temperature=0.9)
    elif i % 7 == 3:
        kw.update(temperature=0)
    # else: no temperature, no seed: the server's default, random sampling
    if i % 4 == 2 and kw.get("temperature") != 0:  # (vLLM refuses n > 1 with greedy)
        kw["n"] = 2
    return {"chat": i % 2 == 0, "stream": i % 5 < 3, "text": text, "kw": kw}


async def run_case(client, model: str, c: dict) -> tuple[str, list[str]]:
    """('ok', finish reasons) when every choice ended with length or stop, else why not."""
    n = c["kw"].get("n", 1)
    if c["chat"]:
        call = client.chat.completions.create
        body = {"messages": [{"role": "user", "content": c["text"]}]}
    else:
        call = client.completions.create
        body = {"prompt": c["text"]}
    try:
        if c["stream"]:
            finishes: dict[int, str] = {}
            async for chunk in await call(model=model, stream=True, **body, **c["kw"]):
                for ch in chunk.choices:
                    if ch.finish_reason:
                        finishes[ch.index] = ch.finish_reason
            reasons = [finishes.get(k, "none") for k in range(n)]
        else:
            r = await call(model=model, **body, **c["kw"])
            reasons = [ch.finish_reason for ch in sorted(r.choices, key=lambda ch: ch.index)]
    except openai.APIError as e:
        return f"error: {e}", []
    whole = len(reasons) == n and all(f in ("length", "stop") for f in reasons)
    return ("ok" if whole else "short"), reasons


def test_real_client_defaults_under_load(pd_server, model_dir):
    rng = random.Random(11)
    cases = [case(i, rng) for i in range(REQUESTS)]
    before = pool_pids(pd_server.base)

    async def drive():
        client = openai.AsyncOpenAI(base_url=pd_server.v1, api_key="none", timeout=300,
                                    max_retries=0)
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(c):
            async with sem:
                return await run_case(client, model_dir, c)

        return await asyncio.gather(*(one(c) for c in cases))

    t0 = time.monotonic()
    results = asyncio.run(drive())
    took = time.monotonic() - t0
    outcomes = [r for r, _ in results]
    print(f"\nreal-client mix: {REQUESTS} requests, {CONCURRENCY} at once, {took:.1f} s: "
          f"{outcomes.count('ok')} whole, {outcomes.count('short')} short, "
          f"{sum(o.startswith('error') for o in outcomes)} failed")
    assert [o for o in outcomes if o != "ok"] == []
    # The same engines serve afterwards: none died and was replaced.
    assert pool_pids(pd_server.base) == before


def test_conversations_with_a_shared_system_prompt_come_back_turn_after_turn(pd_server,
                                                                            model_dir):
    """Chat as agents and chat apps send it: one long system prompt shared by every
    conversation, each turn resending the whole conversation with the assistant's (randomly
    sampled) replies in it, several conversations at once."""
    rng = random.Random(21)
    system = " ".join(rng.choice(WORDS) for _ in range(600))
    before = pool_pids(pd_server.base)

    async def conversation(client, k: int) -> list[str]:
        messages = [{"role": "system", "content": system}]
        reasons = []
        for turn in range(4):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(40, 120)))
            messages.append({"role": "user", "content": f"{k}.{turn} {question}"})
            text, finish = "", None
            async for chunk in await client.chat.completions.create(
                    model=model_dir, messages=messages, max_tokens=40, stream=True):
                for ch in chunk.choices:
                    text += ch.delta.content or ""
                    finish = ch.finish_reason or finish
            reasons.append(finish or "none")
            messages.append({"role": "assistant", "content": text})
        return reasons

    async def drive():
        client = openai.AsyncOpenAI(base_url=pd_server.v1, api_key="none", timeout=300,
                                    max_retries=0)
        return await asyncio.gather(*(conversation(client, k) for k in range(8)))

    reasons = [r for conv in asyncio.run(drive()) for r in conv]
    print(f"\nconversations: 8 x 4 turns over a shared system prompt: "
          f"{sum(r in ('length', 'stop') for r in reasons)} of {len(reasons)} whole")
    assert all(r in ("length", "stop") for r in reasons), reasons
    assert pool_pids(pd_server.base) == before


def test_streams_beyond_the_decode_engines_slots_wait_before_their_first_token(pd_server,
                                                                              model_dir):
    """More streams at once than the decode engine runs (its --max-num-seqs, 128 by default on
    a CPU): the rest wait in the controller's line before their prefill, never inside the
    decode engine with their first token already out (a fast first token, then seconds of
    silence). Every stream is whole."""
    base = pd_server.base
    # (Earlier tests may have replaced a worker: its dead entry is still listed.)
    slots = {w["id"]: w["max_seqs"] for w in get_json(base + "/pd/workers")
             if w["role"] == "decode" and w["state"] == "ready"}
    assert slots and all(slots.values())
    n = sum(slots.values()) + 32  # short prompts, long answers: the decode engines run out
    in_engine: dict[str, list[int]] = {wid: [] for wid in slots}  # running + waiting there
    in_line: list[float] = []  # sequences waiting in the controller's line

    async def sample(done: asyncio.Event) -> None:
        while not done.is_set():
            for w in await asyncio.to_thread(get_json, base + "/pd/workers"):
                if w["id"] in in_engine:
                    in_engine[w["id"]].append(w["running"] + w["waiting"])
            in_line.append(await asyncio.to_thread(metric, base, "pdserve_queued_sequences"))
            await asyncio.sleep(0.2)

    async def drive() -> list[str]:
        client = openai.AsyncOpenAI(base_url=pd_server.v1, api_key="none", timeout=300,
                                    max_retries=0)
        rng = random.Random(31)
        done = asyncio.Event()
        sampler = asyncio.create_task(sample(done))
        try:
            results = await asyncio.gather(*(run_case(client, model_dir, {
                "chat": False, "stream": True, "kw": {"max_tokens": 160},
                "text": " ".join(rng.choice(WORDS) for _ in range(40))}) for _ in range(n)))
            return [outcome for outcome, _ in results]
        finally:
            done.set()
            await sampler

    outcomes = asyncio.run(drive())
    held = {wid: max(seen) for wid, seen in in_engine.items()}
    print(f"\n{n} streams at once, decode slots {slots}: {outcomes.count('ok')} whole; the "
          f"decode engines held at most {held}, the line at most {max(in_line):.0f}")
    assert outcomes == ["ok"] * n
    assert all(held[wid] <= slots[wid] for wid in slots), (held, slots)
    assert max(in_line) > 0


def test_unseeded_random_sampling_varies_and_is_whole(pd_client, model_dir):
    """Random sampling really is random (pdserve no longer seeds it) and each answer is whole."""
    prompt = prompt_ids(300, seed=12_000)
    outs = [pd_client.completions.create(model=model_dir, prompt=prompt, max_tokens=24,
                                         extra_body={"ignore_eos": True})
            for _ in range(4)]
    texts = {o.choices[0].text for o in outs}
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    assert all(o.usage.completion_tokens == 24 for o in outs)
    assert len(texts) > 1


def vllm_bench(pd_server, model_dir, tmp_path, *args: str) -> dict:
    """Run vLLM's own load generator against pdserve; its saved result."""
    import subprocess

    out = tmp_path / "bench.json"
    code = ("import sys\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "import vllm.benchmarks.serve as s\n"
            "p = FlexibleArgumentParser(); s.add_cli_args(p)\n"
            "s.main(p.parse_args(sys.argv[1:]))\n")
    cmd = [sys.executable, "-c", code, "--base-url", pd_server.base, "--model", model_dir,
           "--tokenizer", model_dir, *args,
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", out.name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    print(f"completed {result['completed']}, failed {result.get('failed', 0)}, "
          f"TTFT p50 {result['median_ttft_ms']:.1f} ms p99 {result['p99_ttft_ms']:.1f} ms, "
          f"ITL p50 {result['median_itl_ms']:.1f} ms, {result['duration']:.1f} s, "
          f"{result['output_throughput']:.0f} output tokens/s")
    return result


def test_vllm_benchmark_client_on_chat_with_random_sampling(pd_server, model_dir, tmp_path):
    """vLLM's own load generator, chat endpoint, no temperature (random sampling): 0 failed."""
    print("\nvllm bench serve (openai-chat, random 300/64, 8 at once, 48 prompts): ", end="")
    result = vllm_bench(pd_server, model_dir, tmp_path, "--backend", "openai-chat",
                        "--endpoint", "/v1/chat/completions", "--dataset-name", "random",
                        "--random-input-len", "300", "--random-output-len", "64",
                        "--max-concurrency", "8", "--num-prompts", "48", "--seed", "5",
                        "--ignore-eos")
    assert result["completed"] == 48
    assert result.get("failed", 0) == 0
    assert result["total_output_tokens"] == 48 * 64


def test_vllm_benchmark_client_with_all_its_defaults(pd_server, model_dir, tmp_path):
    """vLLM's load generator with nothing but where to send and the model: 1,000 random prompts
    of 1,024 tokens, 128 out, all sent at once. Every one is served: the burst arrives before
    any request finishes, so admission cannot estimate the wait at the door, and the line
    drains within the default queue timeout instead of refusing its tail inside 200 streams."""
    pids = pool_pids(pd_server.base)
    print("\nvllm bench serve (all its defaults: 1,000 at once, random 1,024/128): ", end="")
    result = vllm_bench(pd_server, model_dir, tmp_path)
    assert result["completed"] == 1000
    assert result.get("failed", 0) == 0
    assert pool_pids(pd_server.base) == pids  # no worker died or was replaced
