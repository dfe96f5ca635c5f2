"""The fake engine behaves as the control-plane tests assume (and as vLLM + NIXL do)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from vllm import SamplingParams
from vllm.outputs import RequestOutput

from pdserve import fake
from pdserve.fake import FakeEngine, reference
from pdserve.worker.engine import decode_params, expected_info

PROMPT = list(range(10, 50))  # 40 tokens: 3 blocks of 16


def params(max_tokens=8, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def with_kv(p: SamplingParams, kv: dict) -> SamplingParams:
    p = p.clone()
    p.extra_args = {"kv_transfer_params": kv}
    return p


async def run(engine, rid, prompt, p) -> list[RequestOutput]:
    return [o async for o in engine.generate(rid, prompt, p)]


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.outputs[0].token_ids]


async def prefill(engine, rid="r1", prompt=PROMPT) -> tuple[list[int], dict]:
    outs = await run(engine, rid, prompt, with_kv(params(1), {"do_remote_decode": True}))
    return tokens(outs), outs[-1].kv_transfer_params


def test_output_depends_only_on_the_context():
    full = reference(PROMPT, params(20)).token_ids
    assert reference(PROMPT + full[:7], params(13)).token_ids == full[7:]
    assert reference([1, 2] + PROMPT, params(20)).token_ids == full  # only the last tokens count


async def test_outputs_are_vllm_delta_request_outputs():
    e = FakeEngine()
    outs = await run(e, "r", PROMPT, params(5, logprobs=1, prompt_logprobs=0))
    assert all(isinstance(o, RequestOutput) for o in outs) and len(outs) == 5
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 5
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert outs[0].prompt_logprobs is not None and outs[1].prompt_logprobs is None
    ref = reference(PROMPT, params(5))
    assert tokens(outs) == ref.token_ids
    assert "".join(o.outputs[0].text for o in outs) == ref.text
    assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(ref.cumulative_logprob)
    assert e.active_requests() == []


async def test_prefill_holds_blocks_until_one_decode_reads_them():
    p, d = FakeEngine(kv_port=1), FakeEngine(kv_port=2)
    first, kv = await prefill(p)
    assert kv["do_remote_prefill"] and kv["remote_engine_id"] == p.engine_id
    assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", 1)
    assert kv["remote_num_tokens"] == 40 and len(kv["remote_block_ids"]) == 3
    assert p.held_blocks() == 3 and p.load().kv_usage > 0
    await p.abort(["r1"])  # as vLLM: aborting a finished prefill frees nothing
    assert p.held_blocks() == 3
    outs = await run(d, "r1-d", PROMPT, with_kv(params(6), kv))
    assert tokens(outs)[0] == first[0]  # the decode redraws the first token
    assert tokens(outs) == reference(PROMPT, params(6)).token_ids
    assert outs[0].num_cached_tokens == 32 and p.held_blocks() == 0 and d.kv_reads == 1
    with pytest.raises(RuntimeError, match="holds no blocks"):
        await run(d, "r1-d2", PROMPT, with_kv(params(6), kv))  # read twice
    assert d.active_requests() == []


async def test_decode_reading_another_prompts_blocks_fails():
    p, d = FakeEngine(), FakeEngine()
    _, kv = await prefill(p)
    with pytest.raises(RuntimeError, match="another prompt"):
        await run(d, "x", [9] + PROMPT[1:], with_kv(params(3), kv))


async def test_release_and_timeout_free_held_blocks():
    p, d = FakeEngine(), FakeEngine()
    _, kv = await prefill(p, "a")
    await d.release("rel", kv)
    assert p.held_blocks() == 0
    p.hold_timeout = 0.0
    await prefill(p, "b")
    await asyncio.sleep(0.01)
    assert p.held_blocks() == 0


async def test_a_prefill_ending_at_eos_holds_nothing():
    prompt = next([7, i] for i in range(10_000)
                  if reference([7, i], SamplingParams(max_tokens=1, temperature=0.0)
                               ).finish_reason == "stop")
    p = FakeEngine()
    outs = await run(p, "r", prompt, with_kv(SamplingParams(max_tokens=1, temperature=0.0),
                                             {"do_remote_decode": True}))
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].kv_transfer_params is None
    assert p.held_blocks() == 0


async def test_reading_from_a_dead_prefill_engine_fails():
    p, d = FakeEngine(), FakeEngine()
    _, kv = await prefill(p)
    p.die()
    with pytest.raises(RuntimeError, match="dead"):
        await run(d, "x", PROMPT, with_kv(params(3), kv))
    unknown = dict(kv, remote_engine_id="in-another-process")
    assert len(tokens(await run(d, "y", PROMPT, with_kv(params(3), unknown)))) == 3


def test_min_tokens_masks_eos_and_stop_tokens():
    prompt = next([7, i] for i in range(10_000)
                  if reference([7, i], SamplingParams(max_tokens=1, temperature=0.0)
                               ).finish_reason == "stop")
    ref = reference(prompt, SamplingParams(max_tokens=5, temperature=0.0, min_tokens=3))
    assert len(ref.token_ids) >= 3 and fake.EOS_TOKEN_ID not in ref.token_ids[:3]
    ignoring = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert reference(prompt, ignoring).finish_reason == "length"


def test_stop_strings_are_held_back_until_decided():
    full = reference(PROMPT, params(12))
    stop = full.text[9:15]
    p = params(12, stop=[stop])
    s = fake._Sampler(p, fake.EOS_TOKEN_ID, fake.VOCAB_SIZE)
    ctx, text = list(PROMPT), ""
    while s.out.finish_reason is None:
        tok, delta = s.step(ctx)
        ctx.append(tok)
        text += delta
        assert stop not in text
    assert text == s.out.text == full.text[:9] and s.out.stop_reason == stop


async def test_abort_ends_the_stream_with_an_abort_output():
    e = FakeEngine(decode_delay=0.01)
    agen = e.generate("r", PROMPT, params(100))
    outs = [await agen.__anext__()]
    await e.abort(["r"])
    outs += [o async for o in agen]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert e.active_requests() == []


async def test_failure_injection():
    e = FakeEngine(fail_after_tokens=2)
    with pytest.raises(RuntimeError, match="injected"):
        await run(e, "r", PROMPT, params(5))
    assert e.active_requests() == []
    e = FakeEngine(stall_after_tokens=1)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(run(e, "r", PROMPT, params(5)), 0.2)
    e = FakeEngine()
    await e.check_health()
    e.die()
    with pytest.raises(fake.FakeEngineDead):
        await e.check_health()
    with pytest.raises(fake.FakeEngineDead):
        await run(e, "r", PROMPT, params(5))


async def test_refuses_what_vllm_refuses():
    e = FakeEngine()
    with pytest.raises(ValueError):
        await run(e, "r", list(range(5000)), params(2))
    with pytest.raises(ValueError):
        await run(e, "r", [], params(2))


def test_decode_params_reads_vllm_sampling_params():
    p = params(7, stop_token_ids=[3], logprobs=2)
    back = decode_params(msgspec.msgpack.encode(p))
    assert isinstance(back, SamplingParams)
    assert (back.max_tokens, back.stop_token_ids, back.logprobs) == (7, [3], 2)


def test_decoded_params_are_not_deep_copied_by_vllm():
    p = params(7)
    p.extra_args = {"kv_transfer_params": {"remote_block_ids": list(range(125))}}
    back = decode_params(msgspec.msgpack.encode(p))
    copy = back.clone()  # what vLLM's input processing does with a request's params
    assert copy is not back and copy.extra_args is back.extra_args


def test_infos(vllm_config):
    assert fake.fake_info().block_size == 16 and fake.fake_info(dtype="x").dtype == "x"
    # What `python -m pdserve.fake worker --model DIR` reports, and a controller on DIR admits.
    assert expected_info(vllm_config).kv_connector == "nixl"
