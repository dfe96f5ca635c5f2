"""Turns the deltas that workers send into the RequestOutputs vLLM's server expects (pure logic).

Workers always stream DELTA outputs; the client asked for DELTA (streaming), CUMULATIVE or
FINAL_ONLY (non-streaming). A `Stream` keeps what one request has produced so far, so that it can
answer in any kind, report what the client has seen (for migration), and never emit a token twice.

This runs once per token of every stream the controller carries: a delta is appended without
copies, a sequence's text is joined only when a whole output is asked for, and a DELTA stream
gathers what is new straight into the CompletionOutput it hands out next (its lists are that
output's alone).
"""

from __future__ import annotations

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from pdserve.protocol import SeqDelta, TokenLogprob


def _lp_dict(entries: list[TokenLogprob]) -> dict[int, Logprob]:
    return {e.token_id: Logprob(e.logprob, e.rank, e.decoded) for e in entries}


class _Seq:
    """One sequence's output so far."""

    __slots__ = ("index", "_text", "token_ids", "logprobs", "cumulative_logprob",
                 "finish_reason", "stop_reason")

    def __init__(self, index: int, logprobs: list[dict[int, Logprob]] | None = None):
        self.index = index
        self._text: list[str] = []  # joined when read: no quadratic concatenation
        self.token_ids: list[int] = []
        self.logprobs = logprobs
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""


class Stream:
    """Everything one client request has produced so far, for any number of sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 kind: RequestOutputKind, n: int = 1, want_logprobs: bool = False):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.kind = kind
        self._delta = kind == RequestOutputKind.DELTA
        self.seqs = [_Seq(i, [] if want_logprobs else None) for i in range(n)]
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.num_cached_tokens: int | None = None
        # DELTA kind: what arrived since the last emit, by sequence, as it will go out.
        self._pending: dict[int, CompletionOutput] = {}
        self._running = n  # sequences without a finish reason
        self._emitted = False

    @property
    def finished(self) -> bool:
        return self._running == 0

    def tokens(self, index: int = 0) -> list[int]:
        return self.seqs[index].token_ids

    def text(self, index: int = 0) -> str:
        return self.seqs[index].text

    def set_prompt_logprobs(self, entries: list[list[TokenLogprob] | None] | None) -> None:
        if entries is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None if e is None else _lp_dict(e) for e in entries]

    def add(self, delta: SeqDelta, index: int | None = None) -> None:
        """Append a worker's delta to sequence `index` (default: the delta's own index)."""
        seq = self.seqs[delta.index if index is None else index]
        if seq.finish_reason is not None:
            return  # nothing may follow a finished sequence
        if delta.text:
            seq._text.append(delta.text)
        seq.token_ids += delta.token_ids
        new_lps = None
        if seq.logprobs is not None and delta.logprobs is not None:
            new_lps = [_lp_dict(p) for p in delta.logprobs]
            seq.logprobs += new_lps
        if delta.cumulative_logprob is not None:
            seq.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            seq.finish_reason = delta.finish_reason
            self._running -= 1
        seq.stop_reason = delta.stop_reason
        if self._delta:
            p = self._pending.get(seq.index)
            if p is None:
                self._pending[seq.index] = CompletionOutput(
                    seq.index, delta.text, list(delta.token_ids), seq.cumulative_logprob,
                    new_lps, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
                return
            # Deltas the server has not taken yet are merged as vLLM's output collector
            # merges them (RequestOutput.add): a few at most, while its reader is busy.
            p.text += delta.text
            p.token_ids += delta.token_ids
            if new_lps is not None and p.logprobs is not None:
                p.logprobs += new_lps
            p.cumulative_logprob = seq.cumulative_logprob
            p.finish_reason, p.stop_reason = seq.finish_reason, seq.stop_reason

    def emit(self) -> RequestOutput | None:
        """The RequestOutput to hand to the server now, or None if there is nothing to say."""
        if self._delta:
            if not self._pending:
                return None
            pending = self._pending
            self._pending = {}
            return self._output(list(pending.values()) if len(pending) == 1
                                else [pending[i] for i in sorted(pending)])
        if self.kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        return self._output([CompletionOutput(
            s.index, s.text, list(s.token_ids), s.cumulative_logprob,
            list(s.logprobs) if s.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in self.seqs])

    def _output(self, outs: list[CompletionOutput]) -> RequestOutput:
        # A DELTA stream carries the prompt logprobs once, in its first output (as vLLM does).
        prompt_lps = self.prompt_logprobs
        if self._delta and self._emitted:
            prompt_lps = None
        self._emitted = True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             prompt_lps, outs, finished=self._running == 0,
                             num_cached_tokens=self.num_cached_tokens)
