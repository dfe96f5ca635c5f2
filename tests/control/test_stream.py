"""Worker deltas turned into the RequestOutputs vLLM's server expects, in each output kind."""

from __future__ import annotations

import pytest
from vllm.sampling_params import RequestOutputKind

from pdserve.controller.stream import Stream
from pdserve.protocol import SeqDelta, TokenLogprob

DELTA, CUMULATIVE, FINAL = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                            RequestOutputKind.FINAL_ONLY)


def d(tokens, text=None, index=0, finish=None, stop=None, lps=False, cum=None):
    return SeqDelta(index, text if text is not None else "".join(f" t{t}" for t in tokens),
                    list(tokens),
                    [[TokenLogprob(t, -0.5, 1, f" t{t}")] for t in tokens] if lps else None,
                    cum, finish, stop)


def test_delta_emits_only_what_is_new():
    s = Stream("r", "p", [1, 2], DELTA)
    assert s.emit() is None
    s.add(d([5]))
    s.add(d([6]))
    out = s.emit()
    assert out.outputs[0].token_ids == [5, 6] and out.outputs[0].text == " t5 t6"
    assert not out.finished and out.request_id == "r" and out.prompt_token_ids == [1, 2]
    assert s.emit() is None
    s.add(d([7], finish="length"))
    out = s.emit()
    assert out.outputs[0].token_ids == [7] and out.finished
    assert out.outputs[0].finish_reason == "length"
    assert s.tokens() == [5, 6, 7]


def test_delta_outputs_not_taken_yet_merge_into_one_that_owns_its_lists():
    s = Stream("r", None, [1], DELTA, want_logprobs=True)
    first = d([5], lps=True, cum=-0.5)
    s.add(first)
    s.add(d([6, 7], lps=True, cum=-1.5))
    o = s.emit().outputs[0]
    assert o.token_ids == [5, 6, 7] and o.text == " t5 t6 t7"
    assert [list(lp) for lp in o.logprobs] == [[5], [6], [7]] and o.cumulative_logprob == -1.5
    assert first.token_ids == [5]  # the worker's delta did not become the output's list
    s.add(d([8], lps=True, cum=-2.0, finish="length"))
    assert o.token_ids == [5, 6, 7] and len(o.logprobs) == 3  # what came next is not in it
    last = s.emit().outputs[0]
    assert last.token_ids == [8] and last.finish_reason == "length"
    assert s.tokens() == [5, 6, 7, 8] and s.text() == " t5 t6 t7 t8"


def test_cumulative_emits_everything_so_far():
    s = Stream("r", None, [1], CUMULATIVE)
    s.add(d([5]))
    assert s.emit().outputs[0].token_ids == [5]
    s.add(d([6], finish="stop", stop=6))
    out = s.emit()
    assert out.outputs[0].token_ids == [5, 6] and out.outputs[0].text == " t5 t6"
    assert out.finished and out.outputs[0].stop_reason == 6


def test_final_only_waits_for_the_end():
    s = Stream("r", None, [1], FINAL)
    s.add(d([5]))
    assert s.emit() is None
    s.add(d([6], finish="length"))
    out = s.emit()
    assert out.finished and out.outputs[0].token_ids == [5, 6]


def test_nothing_follows_a_finished_sequence():
    s = Stream("r", None, [1], CUMULATIVE)
    s.add(d([5], finish="stop"))
    s.add(d([6]))  # e.g. a late delta from a worker the request moved away from
    assert s.tokens() == [5] and s.emit().outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL])
def test_n_sequences_finish_together(kind):
    s = Stream("r", None, [1], kind, n=2)
    s.add(d([5], index=1, finish="length"))
    s.add(d([6], index=0))
    out = s.emit()
    if kind == FINAL:
        assert out is None
    else:
        assert not out.finished and {c.index for c in out.outputs} == {0, 1}
    s.add(d([7], index=0, finish="length"), index=0)
    out = s.emit()
    assert out.finished
    if kind == DELTA:
        assert [(c.index, c.token_ids) for c in out.outputs] == [(0, [7])]
    else:
        assert [(c.index, c.token_ids) for c in out.outputs] == [(0, [6, 7]), (1, [5])]


def test_index_argument_overrides_the_deltas_own():
    s = Stream("r", None, [1], CUMULATIVE, n=2)
    s.add(d([5], index=0), index=1)  # workers always say 0; the controller knows better
    assert s.tokens(1) == [5] and s.tokens(0) == []


def test_logprobs_accumulate_and_prompt_logprobs_come_once_in_delta():
    s = Stream("r", None, [1, 2], DELTA, want_logprobs=True)
    s.set_prompt_logprobs([None, [TokenLogprob(2, -0.1, 1, "x")]])
    s.set_prompt_logprobs([None, None])  # a second report (e.g. after a retry) is ignored
    s.add(d([5], lps=True, cum=-0.5))
    first = s.emit()
    assert first.prompt_logprobs[1][2].logprob == -0.1
    assert first.outputs[0].logprobs[0][5].logprob == -0.5
    s.add(d([6], lps=True, cum=-1.0, finish="length"))
    second = s.emit()
    assert second.prompt_logprobs is None
    assert len(second.outputs[0].logprobs) == 1 and second.outputs[0].cumulative_logprob == -1.0


def test_cumulative_logprobs_and_cached_tokens():
    s = Stream("r", None, [1, 2], CUMULATIVE, want_logprobs=True)
    s.num_cached_tokens = 16
    s.add(d([5], lps=True, cum=-0.5))
    s.add(d([6], lps=True, cum=-1.0))
    out = s.emit()
    assert len(out.outputs[0].logprobs) == 2 and out.outputs[0].cumulative_logprob == -1.0
    assert out.num_cached_tokens == 16
    assert Stream("r", None, [1], CUMULATIVE).emit().outputs[0].logprobs is None


def test_empty_deltas_carry_a_finish():
    s = Stream("r", None, [1], DELTA)
    s.add(d([5]))
    s.emit()
    s.add(d([], finish="abort"))
    out = s.emit()
    assert out.finished and out.outputs[0].token_ids == []
    assert out.outputs[0].finish_reason == "abort"
