"""Failures before and after the handoff: retries, migrations, and clear errors instead of hangs."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import pytest
import zmq
from fakepool import fast_settings, final_tokens, greedy, retries, wait_until
from vllm.exceptions import GracefulHTTPError
from vllm.sampling_params import StructuredOutputsParams

from pdserve import fake, protocol
from pdserve.protocol import Role
from pdserve.worker.engine import FORCED_TOKENS_ARG
from pdserve.worker.worker import PDWorker

PROMPT = list(range(400, 450))


async def test_prefill_error_before_handoff_is_retried_on_another_worker(cluster):
    bad, = await cluster.add("prefill", fail_after_tokens=0)  # chosen first (lowest id)
    good, = await cluster.add("prefill")
    await cluster.add("decode")
    outs = await cluster.run(PROMPT, greedy(6))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(6)).token_ids
    assert len(bad.engine.served) == 1 and len(good.engine.served) == 1
    assert retries(cluster, "prefill_retry") == 1
    await cluster.assert_clean()


async def test_prefill_worker_killed_mid_prefill_is_retried(cluster):
    slow, = await cluster.add("prefill", prefill_delay_per_token=0.2)
    await cluster.add("prefill")
    await cluster.add("decode")
    req = asyncio.create_task(cluster.run(PROMPT, greedy(6)))
    await wait_until(lambda: slow.engine.active_requests(), what="the prefill to start")
    await cluster.kill(slow.worker_id)
    outs = await req
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(6)).token_ids
    assert retries(cluster, "prefill_retry") == 1
    await cluster.assert_clean()


@pytest.mark.parametrize("how", ["killed", "engine_error"])
async def test_decode_worker_lost_mid_stream_is_migrated_without_gaps(cluster, how):
    await cluster.add("prefill")
    kw = {"fail_after_tokens": 7} if how == "engine_error" else {"decode_delay": 0.02}
    d1, = await cluster.add("decode", **kw)
    d2, = await cluster.add("decode")
    params = greedy(30)
    req = asyncio.create_task(cluster.run(PROMPT, params))
    if how == "killed":
        await wait_until(lambda: d1.engine.active_requests(), what="decode to start")
        await asyncio.sleep(0.15)
        await cluster.kill(d1.worker_id)
    outs = await req
    tokens = final_tokens(outs)
    assert tokens == fake.reference(PROMPT, params).token_ids  # no duplicate, none missing
    assert all(o.outputs[0].token_ids for o in outs)  # no empty DELTA output
    assert len(d2.engine.served) == 1 and retries(cluster, "migration") == 1
    text = "".join(c.text for o in outs for c in o.outputs)
    assert text == fake.reference(PROMPT, params).text
    await cluster.assert_clean()


@pytest.mark.parametrize("constraint", [
    {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"bad_words": ["never"]},
    {"structured_outputs": StructuredOutputsParams(regex="[a-z ]+")}],
    ids=["presence-penalty", "frequency-penalty", "bad-words", "grammar"])
async def test_a_migrated_stream_whose_sampler_counts_its_outputs_redraws_them_as_outputs(
        cluster, constraint):
    # Put in the new engine's context, the tokens already streamed would escape its penalties
    # and restart its grammar: they are drawn again (forced), as outputs.
    await cluster.add("prefill")
    await cluster.add("decode", fail_after_tokens=7)
    d2, = await cluster.add("decode")
    params = greedy(30, **constraint)
    outs = await cluster.run(PROMPT, params)
    tokens, ref = final_tokens(outs), fake.reference(PROMPT, greedy(30))
    assert tokens == ref.token_ids
    assert "".join(c.text for o in outs for c in o.outputs) == ref.text  # none of it twice
    [(context, leg)] = d2.engine.received
    forced = leg.extra_args[FORCED_TOKENS_ARG]
    assert context == PROMPT and len(forced) > 1 and forced == tokens[:len(forced)]
    assert leg.max_tokens == 30 and retries(cluster, "migration") == 1
    await cluster.assert_clean()


@pytest.mark.parametrize("after", [3, 7, 12])
@pytest.mark.parametrize("stop", ["absent", "across"])
async def test_a_migrated_stream_with_stop_strings_loses_no_held_back_text(cluster, after, stop):
    # The detokenizer holds back the last characters while they could begin a stop string:
    # the tokens they belong to are drawn again, with the stop string's whole window.
    # "across": one that begins in the last token the first decode worker drew and ends in
    # the next, so it is still being held back when that worker fails.
    ref = fake.reference(PROMPT, greedy(30))
    cut = len("".join(fake.token_text(t) for t in ref.token_ids[:after]))
    word = ref.text[cut - 2:cut + 3] if stop == "across" else "never in the text"
    assert ref.text.find(word) in (cut - 2, -1)
    await cluster.add("prefill")
    await cluster.add("decode", fail_after_tokens=after - 1)  # the prefill draws the first
    await cluster.add("decode")
    params = greedy(30, stop=[word])
    outs = await cluster.run(PROMPT, params)
    ref = fake.reference(PROMPT, params)
    assert final_tokens(outs) == ref.token_ids
    assert "".join(c.text for o in outs for c in o.outputs) == ref.text
    assert outs[-1].outputs[0].finish_reason == ("stop" if stop == "across" else "length")
    assert retries(cluster, "migration") == 1
    await cluster.assert_clean()


@pytest.mark.parametrize("after", [3, 6, 9, 12, 15])
async def test_a_migrated_stream_loses_no_text_of_a_character_its_merged_outputs_cut(
        cluster, after):
    # Outputs of three tokens, as vLLM's collector merges those its reader has not taken: one
    # may end with tokens that are part of a character, whose text has not come. They are
    # drawn again, so their text comes with the next token's.
    engine = {"split_characters": True}
    await cluster.add("prefill", **engine)
    await cluster.add("decode", fail_after_tokens=after, tokens_per_output=3, **engine)
    await cluster.add("decode", **engine)
    outs = await cluster.run(PROMPT, greedy(30))
    ref = fake.reference(PROMPT, greedy(30))
    assert final_tokens(outs) == ref.token_ids
    assert "".join(c.text for o in outs for c in o.outputs) == ref.text
    assert retries(cluster, "migration") == 1
    await cluster.assert_clean()


async def test_migrated_request_keeps_logprobs_and_stops_where_one_engine_stops(cluster):
    await cluster.add("prefill")
    await cluster.add("decode", fail_after_tokens=4)
    await cluster.add("decode")
    ref = fake.reference(PROMPT, greedy(25))
    params = greedy(25, logprobs=1, stop_token_ids=[ref.token_ids[12]])
    outs = await cluster.run(PROMPT, params)
    assert final_tokens(outs) == ref.token_ids[:13]
    assert sum(len(c.logprobs) for o in outs for c in o.outputs) == 13
    assert outs[-1].outputs[0].stop_reason == ref.token_ids[12]


async def test_no_prefill_worker_is_a_503_not_a_hang_with_the_fallback_off(make_cluster):
    cluster = await make_cluster(settings=fast_settings(fallback=False))
    p, = await cluster.add("prefill")
    await cluster.add("decode")
    await cluster.kill(p.worker_id)
    await wait_until(lambda: not cluster.pool.registry.ready(Role.PREFILL), 5, "prefill expiry")
    with pytest.raises(GracefulHTTPError) as e:
        await cluster.run(PROMPT, greedy(4), timeout=10)
    assert e.value.http_status == HTTPStatus.SERVICE_UNAVAILABLE and "prefill" in str(e.value)
    with pytest.raises(GracefulHTTPError) as e:
        cluster.controller.check_admission()
    assert e.value.http_status == HTTPStatus.SERVICE_UNAVAILABLE
    await cluster.assert_clean()


async def test_last_decode_worker_dying_mid_stream_is_a_503_with_the_fallback_off(make_cluster):
    cluster = await make_cluster(settings=fast_settings(fallback=False))
    await cluster.add("prefill")
    d, = await cluster.add("decode", decode_delay=0.02)
    req = asyncio.create_task(cluster.run(PROMPT, greedy(200), timeout=15))
    await wait_until(lambda: d.engine.active_requests(), what="decode to start")
    await cluster.kill(d.worker_id)
    with pytest.raises(GracefulHTTPError) as e:
        await req
    assert e.value.http_status == HTTPStatus.SERVICE_UNAVAILABLE and "decode" in str(e.value)
    await cluster.assert_clean()


async def test_empty_pool_is_a_503(cluster):
    with pytest.raises(GracefulHTTPError) as e:
        await cluster.run(PROMPT, greedy(4))
    assert e.value.http_status == HTTPStatus.SERVICE_UNAVAILABLE


class DropsOneBatch:
    """A worker's socket whose send queue is full for one batch of outputs after `after`."""

    def __init__(self, sock, after: int):
        self.sock, self.left, self.dropped = sock, after, 0

    def send_multipart(self, frames, flags=0, copy=True):
        msg = protocol.decode([bytes(f) for f in frames])
        if isinstance(msg, protocol.Output | protocol.Outputs) and not self.dropped:
            self.left -= 1
            if self.left < 0:
                self.dropped += 1
                raise zmq.Again()
        return self.sock.send_multipart(frames, flags=flags, copy=copy)

    def __getattr__(self, name):
        return getattr(self.sock, name)


async def test_a_decode_whose_outputs_were_dropped_is_migrated_without_a_hole(cluster):
    # A later output after a dropped one would stream the answer with tokens missing.
    await cluster.add("prefill")
    d1, = await cluster.add("decode", decode_delay=0.01)
    d2, = await cluster.add("decode")
    [link] = d1.links.values()
    link.sock = DropsOneBatch(link.sock, after=5)
    params = greedy(30)
    outs = await cluster.run(PROMPT, params)
    assert link.sock.dropped == 1
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids  # none missing
    assert len(d2.engine.served) == 1 and retries(cluster, "migration") == 1
    await cluster.assert_clean()  # the leg was aborted in d1's engine too


async def test_a_prefill_whose_last_output_was_dropped_has_its_blocks_freed(cluster):
    # That output names the blocks its engine holds for a decode: the controller never sees it.
    p, = await cluster.add("prefill")
    await cluster.add("decode")
    [link] = p.links.values()
    link.sock = DropsOneBatch(link.sock, after=0)
    params = greedy(8)
    outs = await cluster.run(PROMPT, params)
    assert link.sock.dropped == 1 and len(p.engine.served) == 2  # tried again
    assert final_tokens(outs) == fake.reference(PROMPT, params).token_ids
    await cluster.assert_clean()  # the first attempt's blocks too


async def test_stalled_decode_is_timed_out_and_migrated(make_cluster):
    c = await make_cluster(settings=fast_settings(token_timeout=0.5))
    await c.add("prefill")
    await c.add("decode", stall_after_tokens=5)
    await c.add("decode")
    outs = await c.run(PROMPT, greedy(12))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(12)).token_ids
    assert retries(c, "migration") == 1
    await c.assert_clean()  # the stalled leg was aborted on its worker


async def test_every_decode_stalling_ends_with_a_504(make_cluster):
    c = await make_cluster(settings=fast_settings(token_timeout=0.3, max_retries=1))
    await c.add("prefill")
    await c.add("decode", 2, stall_after_tokens=0)
    with pytest.raises(GracefulHTTPError) as e:
        await c.run(PROMPT, greedy(8), timeout=10)
    assert e.value.http_status == HTTPStatus.GATEWAY_TIMEOUT
    await c.assert_clean()


async def test_stalled_prefill_is_timed_out_and_retried(make_cluster):
    c = await make_cluster(settings=fast_settings(prefill_timeout=0.5))
    await c.add("prefill", stall_after_tokens=0)
    await c.add("prefill")
    await c.add("decode")
    outs = await c.run(PROMPT, greedy(5))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(5)).token_ids
    await c.assert_clean()


async def test_repeated_failures_end_with_a_502(make_cluster):
    c = await make_cluster(settings=fast_settings(max_retries=2))
    await c.add("prefill", 3, fail_after_tokens=0)
    await c.add("decode")
    with pytest.raises(GracefulHTTPError) as e:
        await c.run(PROMPT, greedy(5))
    assert e.value.http_status == HTTPStatus.BAD_GATEWAY
    await c.assert_clean()


async def test_prefill_reporting_kv_at_another_address_is_not_trusted(cluster):
    # A worker registered at 127.0.0.1 whose engine claims its KV lives elsewhere.
    engine = fake.FakeEngine(address="10.1.2.3", kv_port=5555)
    liar = PDWorker(engine, Role.PREFILL, [cluster.address], worker_id="prefill-0-liar",
                    address="127.0.0.1", kv_port=5555, heartbeat_interval=cluster.heartbeat)
    cluster.workers[liar.worker_id] = liar
    cluster.runs[liar.worker_id] = asyncio.create_task(liar.run())
    await wait_until(lambda: cluster.is_ready(liar.worker_id))
    await cluster.add("prefill")
    d, = await cluster.add("decode")
    outs = await cluster.run(PROMPT, greedy(5))
    assert final_tokens(outs) == fake.reference(PROMPT, greedy(5)).token_ids
    assert len(engine.served) == 1 and d.engine.kv_reads == 1
    await cluster.assert_clean()  # the liar's blocks were released too


async def test_invalid_request_is_not_retried(cluster):
    await cluster.add("prefill", 2)
    await cluster.add("decode")
    with pytest.raises(ValueError):
        await cluster.run([i % 1000 for i in range(4096)], greedy(4))
    assert retries(cluster, "prefill_retry") == 0
