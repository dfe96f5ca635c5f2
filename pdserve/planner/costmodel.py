"""A worker's costs: prefill time and decode step time, fit online from what it was seen doing.

    prefill  seconds = a + b*new_tokens + c*new_tokens*context/1000     (one prefill batch)
    decode   step    = d0 + d1*running + d2*kv_tokens/1000              (one engine step)

Why online: a profile measured by `pdserve bench` is one machine on one afternoon; the same
worker runs slower when a neighbour wakes up, and a worker on other hardware has other numbers.
So the profile only seeds the fit. Each fit is a Bayesian linear regression whose prior is the
seed (a handful of samples moves it only as far as they justify, none leaves it as it was),
updated recursively with exponential forgetting (it follows drift: the newest ~1/(1-forget)
samples count most), on errors relative to the time (a 10 ms prefill matters as much to a
placement as a 300 ms one). A residual far outside the recent ones (a GC pause, a preempted
core) is clipped, so one stall does not move the model; a shift that lasts widens the clip
within a few samples. Predictions are never negative.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Protocol

import numpy as np

MIN_SECONDS = 1e-4  # relative errors are taken against at least this much time


class Costs(Protocol):
    """What placement, the role planner and the simulator ask of a worker's costs."""

    def prefill_seconds(self, new_tokens: float, context: float | None = None) -> float: ...

    def step_seconds(self, running: float, kv_tokens: float) -> float: ...

    @property
    def handoff_s(self) -> float: ...


@dataclass(frozen=True)
class Profile:
    """Cost coefficients of one kind of worker (seconds). The defaults are the bench preset model
    on one core of the 2-core development machine (docs/performance.md): a 2,000-token prefill
    ~0.25 s, a decode step ~4.5 ms alone, a handoff ~50 ms."""

    prefill_base_s: float = 0.008  # a: per prefill batch
    prefill_per_token_s: float = 1.2e-4  # b: per new token
    prefill_per_token_ctx_s: float = 0.0  # c: per new token per 1,000 tokens of context
    step_base_s: float = 0.0045  # d0: per decode step
    step_per_running_s: float = 0.0016  # d1: per running request
    step_per_kkv_s: float = 0.0  # d2: per 1,000 KV tokens held by the running requests
    handoff_s: float = 0.05  # prefill result -> first new token on the decode worker
    chunk_tokens: int = 2048  # prefill tokens per engine step (vLLM's max_num_batched_tokens)
    max_running: int = 256  # requests an engine decodes at once (vLLM's max_num_seqs)
    source: str = "default"  # where the numbers came from

    def prefill_seconds(self, new_tokens: float, context: float | None = None) -> float:
        ctx = new_tokens if context is None else context
        return max(0.0, self.prefill_base_s + self.prefill_per_token_s * new_tokens
                   + self.prefill_per_token_ctx_s * new_tokens * ctx / 1000.0)

    def step_seconds(self, running: float, kv_tokens: float) -> float:
        return max(0.0, self.step_base_s + self.step_per_running_s * running
                   + self.step_per_kkv_s * kv_tokens / 1000.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> Profile:
        """From to_json()'s text (or its dict); unknown keys are ignored, missing ones default,
        so a profile written by an older pdserve still loads."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class _Fit:
    """Exponentially weighted recursive least squares on relative errors, with a Gaussian prior.

    theta are the coefficients of the (scaled) features; P their covariance in units of the
    relative noise. P's trace is capped at the prior's so that directions the data never excite
    (e.g. running always 1) do not wind up under forgetting and jump at the next odd sample."""

    def __init__(self, theta0: list[float], prior_std: list[float], forget: float, noise: float):
        self.theta = np.asarray(theta0, dtype=float)
        self.p = np.diag((np.asarray(prior_std, dtype=float) / noise) ** 2)
        self.p_cap = float(np.trace(self.p))
        self.forget = forget
        self.noise = noise
        self.samples = 0
        self.weight = 0.0  # effective samples: sum of forget**age
        self.rel_err = noise  # recent mean |relative residual|, sets the clip

    def predict(self, x: np.ndarray) -> float:
        return max(0.0, float(self.theta @ x))

    def update(self, x: np.ndarray, y: float) -> None:
        scale = max(self.predict(x), MIN_SECONDS)
        xs = x / scale
        err = y / scale - float(self.theta @ xs)
        limit = 4.0 * max(self.rel_err, 0.02)
        err = min(max(err, -limit), limit)
        self.rel_err = 0.9 * self.rel_err + 0.1 * abs(err)
        pxs = self.p @ xs
        gain = pxs / (self.forget + float(xs @ pxs))
        self.theta = self.theta + gain * err
        self.p = (self.p - np.outer(gain, pxs)) / self.forget
        self.p = 0.5 * (self.p + self.p.T)
        trace = float(np.trace(self.p))
        if trace > self.p_cap:
            self.p *= self.p_cap / trace
        self.samples += 1
        self.weight = self.weight * self.forget + 1.0


class CostModel:
    """One worker's live costs. The controller feeds it what it measures
    (`observe` per prefill batch, `observe_step` per decode step or per averaged run of steps,
    `observe_handoff` per KV handoff) and asks it for predictions."""

    def __init__(self, seed: Profile | None = None, *, forget: float = 0.98,
                 noise: float = 0.1, prior_std: float = 1.0, context_term: bool | None = None):
        """`forget`: weight of a sample one observation older (0.98: the last ~50 count);
        `noise`: the relative scatter expected of one sample; `prior_std`: how far off the seed
        may be, relative to its own values; `context_term`: fit c (default: if the seed has one).
        """
        self.seed = seed or Profile()
        s = self.seed
        self.context_term = s.prefill_per_token_ctx_s != 0 if context_term is None \
            else context_term
        # Internal features are scaled to be near 1: new/1000, new*context/1e6, running, kv/1000
        # (so the coefficients are s per 1k tokens, s per 1k tokens per 1k context, s, s).
        theta_p = [s.prefill_base_s, s.prefill_per_token_s * 1e3]
        floor_p = [1e-3, 1e-2]
        if self.context_term:
            theta_p.append(s.prefill_per_token_ctx_s * 1e3)
            floor_p.append(1e-2)
        theta_d = [s.step_base_s, s.step_per_running_s, s.step_per_kkv_s]
        floor_d = [1e-3, 1e-4, 1e-4]
        self._prefill = _Fit(theta_p, _std(theta_p, floor_p, prior_std), forget, noise)
        self._decode = _Fit(theta_d, _std(theta_d, floor_d, prior_std), forget, noise)
        self._handoff = s.handoff_s
        self._handoff_samples = 0
        self._forget = forget

    def _xp(self, new_tokens: float, context: float | None) -> np.ndarray:
        n = new_tokens / 1e3
        if not self.context_term:
            return np.array([1.0, n])
        ctx = new_tokens if context is None else context
        return np.array([1.0, n, n * ctx / 1e3])

    def observe(self, new_tokens: int, seconds: float, context: int | None = None) -> None:
        """One prefill batch of `new_tokens` computed tokens took `seconds` (context: tokens of
        the sequence including the new ones; default: no cached prefix)."""
        if new_tokens > 0 and math.isfinite(seconds) and seconds > 0:
            self._prefill.update(self._xp(new_tokens, context), seconds)

    def observe_step(self, running: int, kv_tokens: int, seconds: float) -> None:
        """One decode step over `running` requests holding `kv_tokens` took `seconds`."""
        if running > 0 and math.isfinite(seconds) and seconds > 0:
            self._decode.update(np.array([1.0, running, kv_tokens / 1e3]), seconds)

    def observe_handoff(self, seconds: float) -> None:
        """A KV handoff (prefill result -> first new token) took `seconds`: an exponentially
        weighted mean, the seed counting as one sample."""
        if math.isfinite(seconds) and seconds >= 0:
            self._handoff_samples += 1
            w = max(1.0 - self._forget, 1.0 / (self._handoff_samples + 1))
            self._handoff += w * (seconds - self._handoff)

    def prefill_seconds(self, new_tokens: float, context: float | None = None) -> float:
        return self._prefill.predict(self._xp(new_tokens, context))

    def step_seconds(self, running: float, kv_tokens: float) -> float:
        return self._decode.predict(np.array([1.0, running, kv_tokens / 1e3]))

    @property
    def handoff_s(self) -> float:
        return self._handoff

    def profile(self) -> Profile:
        """The current fit as a Profile (what the simulator and the role planner take)."""
        tp, td = self._prefill.theta, self._decode.theta
        return replace(self.seed, prefill_base_s=float(tp[0]),
                       prefill_per_token_s=float(tp[1]) / 1e3,
                       prefill_per_token_ctx_s=float(tp[2]) / 1e3 if self.context_term else 0.0,
                       step_base_s=float(td[0]), step_per_running_s=float(td[1]),
                       step_per_kkv_s=float(td[2]), handoff_s=self._handoff,
                       source=f"fit online from {self.seed.source}")

    def snapshot(self) -> dict[str, Any]:
        """Coefficients (ms) and sample counts, for /pd/workers and the dashboard."""
        p = self.profile()
        return {
            "prefill": {"base_ms": round(p.prefill_base_s * 1e3, 3),
                        "per_1k_tokens_ms": round(p.prefill_per_token_s * 1e6, 3),
                        "per_1k_tokens_per_1k_context_ms":
                            round(p.prefill_per_token_ctx_s * 1e6, 3),
                        "samples": self._prefill.samples,
                        "recent_rel_error": round(self._prefill.rel_err, 4)},
            "decode": {"step_base_ms": round(p.step_base_s * 1e3, 3),
                       "per_running_ms": round(p.step_per_running_s * 1e3, 4),
                       "per_1k_kv_ms": round(p.step_per_kkv_s * 1e3, 4),
                       "samples": self._decode.samples,
                       "recent_rel_error": round(self._decode.rel_err, 4)},
            "handoff_ms": round(self._handoff * 1e3, 2),
            "handoff_samples": self._handoff_samples,
            "seed": self.seed.source,
        }


def _std(theta: list[float], floor: list[float], rel: float) -> list[float]:
    return [rel * max(abs(t), f) for t, f in zip(theta, floor)]
