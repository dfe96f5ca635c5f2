"""Turns the deltas that workers send into the RequestOutputs vLLM's server expects (pure logic).

Workers always stream DELTA outputs; the client asked for DELTA (streaming), CUMULATIVE or
FINAL_ONLY (non-streaming). A `Stream` keeps what one request has produced so far, so that it can
answer in any kind, report what the client has seen (for migration), and never emit a token twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from pdserve.protocol import SeqDelta, TokenLogprob


def _lp_dict(entries: list[TokenLogprob]) -> dict[int, Logprob]:
    return {e.token_id: Logprob(e.logprob, e.rank, e.decoded) for e in entries}


@dataclass
class _Seq:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Stream:
    """Everything one client request has produced so far, for any number of sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 kind: RequestOutputKind, n: int = 1, want_logprobs: bool = False):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.kind = kind
        self.seqs = [_Seq(i, logprobs=[] if want_logprobs else None) for i in range(n)]
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.num_cached_tokens: int | None = None
        self._pending: dict[int, _Seq] = {}  # DELTA kind: what arrived since the last emit
        self._emitted = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def tokens(self, index: int = 0) -> list[int]:
        return self.seqs[index].token_ids

    def set_prompt_logprobs(self, entries: list[list[TokenLogprob] | None] | None) -> None:
        if entries is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None if e is None else _lp_dict(e) for e in entries]

    def add(self, delta: SeqDelta, index: int | None = None) -> None:
        """Append a worker's delta to sequence `index` (default: the delta's own index)."""
        seq = self.seqs[delta.index if index is None else index]
        if seq.finish_reason is not None:
            return  # nothing may follow a finished sequence
        seq.text += delta.text
        seq.token_ids.extend(delta.token_ids)
        new_lps = None
        if seq.logprobs is not None and delta.logprobs is not None:
            new_lps = [_lp_dict(p) for p in delta.logprobs]
            seq.logprobs.extend(new_lps)
        if delta.cumulative_logprob is not None:
            seq.cumulative_logprob = delta.cumulative_logprob
        seq.finish_reason = delta.finish_reason
        seq.stop_reason = delta.stop_reason
        if self.kind == RequestOutputKind.DELTA:
            p = self._pending.setdefault(seq.index, _Seq(seq.index,
                                                         logprobs=[] if new_lps is not None else None))
            p.text += delta.text
            p.token_ids.extend(delta.token_ids)
            if new_lps is not None and p.logprobs is not None:
                p.logprobs.extend(new_lps)
            p.cumulative_logprob = seq.cumulative_logprob
            p.finish_reason, p.stop_reason = seq.finish_reason, seq.stop_reason

    def emit(self) -> RequestOutput | None:
        """The RequestOutput to hand to the server now, or None if there is nothing to say."""
        if self.kind == RequestOutputKind.FINAL_ONLY:
            return self._output(self.seqs) if self.finished else None
        if self.kind == RequestOutputKind.CUMULATIVE:
            return self._output(self.seqs)
        if not self._pending:
            return None
        pending = [self._pending[i] for i in sorted(self._pending)]
        self._pending.clear()
        return self._output(pending)

    def _output(self, seqs: list[_Seq]) -> RequestOutput:
        outs = [CompletionOutput(index=s.index, text=s.text, token_ids=list(s.token_ids),
                                 cumulative_logprob=s.cumulative_logprob,
                                 logprobs=None if s.logprobs is None else list(s.logprobs),
                                 finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                for s in seqs]
        # A DELTA stream carries the prompt logprobs once, in its first output (as vLLM does).
        first = not self._emitted
        self._emitted = True
        prompt_lps = self.prompt_logprobs
        if self.kind == RequestOutputKind.DELTA and not first:
            prompt_lps = None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             prompt_lps, outs, finished=self.finished,
                             num_cached_tokens=self.num_cached_tokens)
