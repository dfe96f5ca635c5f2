"""The request path prefill -> KV handoff -> decode, through PDController with fake engines."""

from __future__ import annotations

import pytest
from fakepool import final_tokens, greedy
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from pdserve import fake
from pdserve.worker.engine import FORCED_TOKENS_ARG

PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token blocks and a partial one
DELTA, CUMULATIVE, FINAL = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                            RequestOutputKind.FINAL_ONLY)


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL])
async def test_output_equals_one_engine_run(pd, kind):
    params = greedy(12, kind)
    outs = await pd.run(PROMPT, params)
    assert final_tokens(outs, kind) == fake.reference(PROMPT, params).token_ids
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert all(not o.finished for o in outs[:-1])
    if kind == FINAL:
        assert len(outs) == 1
    if kind == DELTA:  # none repeated (the tokens above), none empty before the last
        assert len(outs) <= 12 and all(o.outputs[0].token_ids for o in outs)
    text = "".join(c.text for o in outs for c in o.outputs) if kind == DELTA \
        else outs[-1].outputs[0].text
    assert text == fake.reference(PROMPT, params).text
    await pd.assert_clean()


async def test_prefill_and_decode_both_ran_with_a_real_handoff(pd):
    p, d = pd.engines()
    await pd.run(PROMPT, greedy(5))
    assert len(p.served) == 1 and len(d.served) == 1
    assert d.kv_reads == 1
    await pd.assert_clean()


@pytest.mark.parametrize("kind", [DELTA, FINAL])
async def test_cached_tokens_are_the_prefill_engines_hits_not_the_kv_handed_over(pd, kind):
    p, d = pd.engines()
    outs = await pd.run(PROMPT, greedy(4, kind))
    assert d.kv_reads == 1  # the decode engine was handed the two full blocks...
    # ...which the prefill engine computed: nothing was cached, in every output (a streaming
    # server reads the count from the first).
    assert {o.num_cached_tokens for o in outs} == {0}
    outs = await pd.run(PROMPT + [7, 8], greedy(4, kind))
    assert {o.num_cached_tokens for o in outs} == {32}  # the prefill engine's two blocks
    await pd.assert_clean()


async def test_cached_tokens_of_a_local_prefill_are_its_engines_hits(make_cluster):
    from fakepool import fast_settings

    c = await make_cluster(settings=fast_settings(local_prefill_threshold=10**6))
    await c.add("decode")
    assert {o.num_cached_tokens for o in await c.run(PROMPT, greedy(4, DELTA))} == {0}
    assert {o.num_cached_tokens for o in await c.run(PROMPT, greedy(4, DELTA))} == {32}
    await c.assert_clean()


def sampled(max_tokens, kind, **kw):
    # The fake engine gives seeded sequences the greedy tokens; unseeded ones draw at random.
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                          output_kind=kind, **kw)


async def test_n_2_gives_two_sequences_from_one_engines_tokens(pd):
    params = sampled(6, FINAL, n=2, seed=3)
    outs = await pd.run(PROMPT, params)
    ref = fake.reference(PROMPT, greedy(6)).token_ids
    assert sorted(c.index for c in outs[-1].outputs) == [0, 1]
    assert final_tokens(outs, FINAL, 0) == ref and final_tokens(outs, FINAL, 1) == ref
    await pd.assert_clean()


async def test_n_2_streaming_interleaves_without_duplicates(pd):
    outs = await pd.run(PROMPT, sampled(6, DELTA, n=2, seed=5))
    ref = fake.reference(PROMPT, greedy(6)).token_ids
    assert final_tokens(outs, DELTA, 0) == ref and final_tokens(outs, DELTA, 1) == ref


async def test_unseeded_random_sampling_needs_no_seed_and_never_forks(pd):
    """The decode engine draws at random too; it is forced to the token the prefill streamed,
    so every request completes on its first prefill and decode leg (no mismatch, no retry)."""
    p, d = pd.engines()
    for _ in range(20):
        outs = await pd.run(PROMPT, sampled(8, DELTA, n=2))
        for i in (0, 1):
            assert len(final_tokens(outs, DELTA, i)) == 8
    assert len(p.served) == len(d.served) == 40
    await pd.assert_clean()


async def test_max_tokens_1_is_served_by_the_prefill_alone(pd):
    _, d = pd.engines()
    params = greedy(1, FINAL)
    outs = await pd.run(PROMPT, params)
    assert final_tokens(outs, FINAL) == fake.reference(PROMPT, params).token_ids
    assert outs[-1].outputs[0].finish_reason == "length"
    assert d.served == []
    await pd.assert_clean()  # the prefill's blocks were released, not stranded


def _prompt_that_stops_at(n_tokens: int) -> list[int]:
    """A prompt whose greedy output ends with eos as token n_tokens."""
    for i in range(10_000):
        prompt = [7, i, i + 1]
        ref = fake.reference(prompt, SamplingParams(max_tokens=50, temperature=0))
        if ref.finish_reason == "stop" and len(ref.token_ids) == n_tokens:
            return prompt
    raise AssertionError("no such prompt")


@pytest.mark.parametrize("at", [1, 2, 5])
async def test_stops_at_eos_like_one_engine(pd, at):
    prompt = _prompt_that_stops_at(at)
    params = SamplingParams(max_tokens=50, temperature=0, output_kind=FINAL)
    outs = await pd.run(prompt, params)
    ref = fake.reference(prompt, params)
    assert final_tokens(outs, FINAL) == ref.token_ids and ref.token_ids[-1] == fake.EOS_TOKEN_ID
    assert outs[-1].outputs[0].finish_reason == "stop"
    await pd.assert_clean()


async def test_eos_as_first_token_with_stop_strings(pd):
    # Stop strings make the decode worker sample the first token itself; a prefill that ends
    # at eos hands over no KV (as NixlConnector), and the request must still end like one engine.
    prompt = _prompt_that_stops_at(1)
    params = SamplingParams(max_tokens=50, temperature=0, stop=["never"], output_kind=FINAL)
    outs = await pd.run(prompt, params)
    assert final_tokens(outs, FINAL) == [fake.EOS_TOKEN_ID]
    assert outs[-1].outputs[0].finish_reason == "stop"
    await pd.assert_clean()


async def test_stop_token_and_min_tokens(pd):
    ref = fake.reference(PROMPT, greedy(20))
    stop_tok = ref.token_ids[3]
    params = greedy(20, FINAL, stop_token_ids=[stop_tok])
    outs = await pd.run(PROMPT, params)
    assert final_tokens(outs, FINAL) == ref.token_ids[:4]
    assert outs[-1].outputs[0].stop_reason == stop_tok
    params = greedy(20, FINAL, stop_token_ids=[stop_tok], min_tokens=6)
    outs = await pd.run(PROMPT, params)
    assert final_tokens(outs, FINAL) == fake.reference(PROMPT, params).token_ids
    assert len(final_tokens(outs, FINAL)) >= 6
    await pd.assert_clean()


async def test_stop_string_is_found_across_the_handoff(pd):
    ref = fake.reference(PROMPT, greedy(20))
    stop = ref.text[8:14]  # spans tokens somewhere after the first
    params = greedy(20, FINAL, stop=[stop])
    outs = await pd.run(PROMPT, params)
    expected = fake.reference(PROMPT, params)
    assert outs[-1].outputs[0].text == expected.text and stop not in expected.text
    assert outs[-1].outputs[0].stop_reason == stop
    await pd.assert_clean()


@pytest.mark.parametrize("length", [1, 15, 16, 17])
async def test_short_prompts(pd, length):
    prompt = list(range(300, 300 + length))
    params = greedy(5)
    outs = await pd.run(prompt, params)
    assert final_tokens(outs) == fake.reference(prompt, params).token_ids
    assert outs[-1].num_cached_tokens == 0  # never seen before
    await pd.assert_clean()


async def test_logprobs_pass_through(pd):
    params = greedy(5, FINAL, logprobs=2, prompt_logprobs=1)
    outs = await pd.run(PROMPT, params)
    ref = fake.reference(PROMPT, params)
    c = outs[-1].outputs[0]
    assert len(c.logprobs) == 5
    for tok, lps in zip(c.token_ids, c.logprobs, strict=True):
        assert lps[tok].rank == 1 and len(lps) == 3
    assert c.cumulative_logprob == pytest.approx(ref.cumulative_logprob)
    plp = outs[-1].prompt_logprobs
    assert plp is not None and len(plp) == len(PROMPT) and plp[0] is None
    assert set(plp[1]) == {PROMPT[1]}


async def test_streamed_logprobs_one_entry_per_token(pd):
    outs = await pd.run(PROMPT, greedy(5, DELTA, logprobs=0))
    seqs = [c for o in outs for c in o.outputs]
    assert [len(c.logprobs) for c in seqs] == [len(c.token_ids) for c in seqs]
    assert sum(len(c.token_ids) for c in seqs) == 5


async def test_local_prefill_below_threshold_skips_the_handoff(make_cluster):
    from fakepool import fast_settings

    c = await make_cluster(settings=fast_settings(local_prefill_threshold=20))
    await c.add("prefill")
    await c.add("decode")
    p, d = c.engines()
    short = list(range(10))
    outs = await c.run(short, greedy(6))
    assert final_tokens(outs) == fake.reference(short, greedy(6)).token_ids
    assert p.served == [] and len(d.served) == 1 and d.kv_reads == 0
    outs = await c.run(PROMPT, greedy(6))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(6)).token_ids
    assert len(p.served) == 1
    await c.assert_clean()


async def test_both_role_worker_serves_alone(cluster):
    await cluster.add("both")
    outs = await cluster.run(PROMPT, greedy(6))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(6)).token_ids
    await cluster.assert_clean()


async def test_client_kv_transfer_params_are_ignored(pd):
    _, d = pd.engines()
    params = greedy(4, extra_args={"kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": "elsewhere", "remote_host": "10.9.9.9",
        "remote_port": 1, "remote_block_ids": [0, 1], "remote_request_id": "x"}})
    outs = await pd.run(PROMPT, params)
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(4)).token_ids
    assert d.kv_reads == 1  # it read from the real prefill, not where the client pointed
    await pd.assert_clean()


async def test_prompt_longer_than_the_context_is_a_value_error(pd):
    with pytest.raises(ValueError):
        await pd.run([i % 1000 for i in range(5000)], greedy(4))
    outs = await pd.run(PROMPT, greedy(4))  # and the system keeps serving
    assert len(final_tokens(outs)) == 4
    await pd.assert_clean()


@pytest.mark.parametrize("bad", [2048, 10**6, -1])
async def test_out_of_vocabulary_token_ids_are_refused_before_any_worker(pd, bad):
    from vllm.exceptions import VLLMValidationError  # vLLM's server answers it with a 400

    with pytest.raises(VLLMValidationError, match="out of vocabulary"):
        await pd.run([1, 2, bad, 3], greedy(4))
    assert [e.served for e in pd.engines()] == [[], []]
    outs = await pd.run(PROMPT, greedy(4))
    assert len(final_tokens(outs)) == 4
    await pd.assert_clean()


async def test_many_concurrent_requests(pd):
    import asyncio

    prompts = [[i, i + 1, i + 2] * (1 + i % 20) for i in range(40)]
    results = await asyncio.gather(*(pd.run(p, greedy(6)) for p in prompts))
    for p, outs in zip(prompts, results, strict=True):
        assert final_tokens(outs) == fake.reference(p, greedy(6)).token_ids
    await pd.assert_clean()


async def test_concurrent_requests_reusing_one_request_id_do_not_mix(pd):
    import asyncio

    # Clients may pick request ids (X-Request-Id); two at once must not share legs.
    a, b = PROMPT, list(range(900, 930))
    outs_a, outs_b = await asyncio.gather(pd.run(a, greedy(10), "same"),
                                          pd.run(b, greedy(10), "same"))
    assert final_tokens(outs_a) == fake.reference(a, greedy(10)).token_ids
    assert final_tokens(outs_b) == fake.reference(b, greedy(10)).token_ids
    await pd.assert_clean()


async def test_decode_worker_continues_from_the_prefills_token(pd):
    """It is given the prompt and the streamed token as its context, with nothing to draw
    again, so its first output is the stream's second token."""
    _, d = pd.engines()
    outs = await pd.run(PROMPT, sampled(8, DELTA))
    tokens = final_tokens(outs, DELTA)
    assert len(tokens) == 8
    [(context, params)] = d.received
    assert context == PROMPT + tokens[:1]
    assert params.max_tokens == 7 and not (params.extra_args or {}).get(FORCED_TOKENS_ARG)
    await pd.assert_clean()


async def test_a_stop_string_makes_the_decode_worker_draw_the_token_again(pd):
    """A stop string may span the prefill's token and the next: the decode engine must see the
    token as an output, so it gets the prompt alone and draws the token again, forced."""
    _, d = pd.engines()
    outs = await pd.run(PROMPT, sampled(8, DELTA, stop=["never-in-the-text"]))
    tokens = final_tokens(outs, DELTA)
    assert len(tokens) == 8
    [(context, params)] = d.received
    assert context == PROMPT
    assert params.max_tokens == 8 and params.extra_args[FORCED_TOKENS_ARG] == tokens[:1]
    await pd.assert_clean()


async def test_requests_prefilling_together_spread_over_the_decode_workers(make_cluster):
    """A decode worker chosen for a request that is still prefilling elsewhere counts that
    stream at once, so a burst does not all go to the worker least loaded when it arrived."""
    import asyncio

    from fakepool import wait_until

    c = await make_cluster()
    await c.add("prefill", prefill_delay_per_token=0.003)  # ~0.1 s per prompt: they overlap
    [busy] = await c.add("decode", decode_delay=0.02)
    long_ones = [asyncio.ensure_future(c.run(list(range(i, i + 40)), greedy(80)))
                 for i in range(3)]
    b = c.pool.registry.workers[busy.worker_id]
    await wait_until(lambda: b.inflight == 3, 10, "three streams on the first decode worker")
    [idle] = await c.add("decode", decode_delay=0.02)
    burst = await asyncio.gather(*(c.run(list(range(500 + i, 540 + i)), greedy(3))
                                   for i in range(6)))
    assert all(len(final_tokens(outs)) == 3 for outs in burst)
    # Without the count, all six would have gone to the idle worker (0 < 3 until they hand off).
    took = len(c.engine(busy.worker_id).served) - 3
    assert 1 <= took and took + len(c.engine(idle.worker_id).served) == 6
    await asyncio.gather(*long_ones)
    await c.assert_clean()
