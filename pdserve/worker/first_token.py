"""Forced tokens: a leg draws the tokens the client already has, then samples as asked.

The prefill worker samples a request's first token and the controller streams it at once. The
decode worker then recomputes the last prompt position from the transferred KV and samples that
position again; its draw must equal the streamed token or the stream would fork. Seeding every
request used to guarantee that, but a per-request generator kills a CPU engine whenever one of
its partial-prefill samples is discarded (vLLM 0.32 rewinds it with `set_offset`, which CPU
generators lack). So instead the leg names the tokens it must reproduce (the prefill's token,
or after a migration the tokens replayed to rebuild the context), and this logits processor
(loaded through vLLM's `logits_processors` engine argument) masks every other token at those
first positions. Later positions are sampled as the client asked. Logprobs are unaffected: vLLM
computes them from the raw logits, and the controller drops these copies anyway.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from pdserve.worker.engine import FORCED_TOKENS_ARG as ARG


def forced_tokens_of(params) -> list[int]:
    value = (params.extra_args or {}).get(ARG)
    return list(value) if isinstance(value, list) else []


class ForcedTokensProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # batch row -> (tokens to draw first, the request's live output-token list)
        self.rows: dict[int, tuple[list[int], list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        value = (sampling_params.extra_args or {}).get(ARG)
        if value is not None and not (isinstance(value, list) and all(
                isinstance(t, int) and t >= 0 for t in value)):
            raise ValueError(f"{ARG} must be a list of token ids, got {value!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy picks too (that is the point)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _entry)
        for row in [r for r, (forced, out) in self.rows.items() if len(out) >= len(forced)]:
            del self.rows[row]  # past its forced tokens

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = list(self.rows)
        tokens = [forced[len(out)] for forced, out in self.rows.values()]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] = float("-inf")
        logits[index, torch.tensor(tokens, dtype=torch.long, device=logits.device)] = 0.0
        return logits


def _entry(params, _prompt_ids, output_ids: list[int]):
    forced = forced_tokens_of(params)
    if len(output_ids) >= len(forced):
        return None
    return forced, output_ids
