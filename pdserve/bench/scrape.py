"""Means of the controller's own phase histograms over one run, from two /metrics scrapes."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pdserve.controller.phases import PHASES

# pdserve_<name>_seconds histograms and counters worth reporting next to the client's figures.
HISTOGRAMS = ("queue_time", "prefill_time", "kv_handoff", "time_to_first_token")
COUNTERS = ("pdserve_local_prefills_total", "pdserve_retries_total",
            "pdserve_requests_total", "pdserve_generation_tokens_total",
            "pdserve_prefix_cached_tokens_total", "pdserve_prompt_tokens_computed_total",
            "pdserve_kv_read_tokens_total", "pdserve_kv_transfer_bytes_sum",
            "pdserve_routes_total", "pdserve_role_changes_total", "pdserve_kv_reads_total")


def parse(text: str) -> dict[str, float]:
    """`{sample name + labels: value}` for pdserve's series (labels joined into the name)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("pdserve_"):
            continue
        for s in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" in s.labels:
                continue
            out[s.name + (f"{{{label}}}" if label else "")] = float(s.value)
    return out


def metrics_text(base_url: str, timeout: float = 5.0) -> str:
    """A server's /metrics page; empty if it cannot be reached."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as r:
            return r.read().decode()
    except OSError:
        return ""


def scrape(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    return parse(metrics_text(base_url, timeout))


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean seconds of each phase histogram and counter increases between two scrapes."""
    out: dict[str, float] = {}
    for h in HISTOGRAMS:
        name = f"pdserve_{h}_seconds"
        n = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
        total = after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)
        if n > 0:
            out[f"{h}_mean_ms"] = round(1e3 * total / n, 2)
            out[f"{h}_count"] = n
    for phase in PHASES:  # the handoff's phases (controller/phases.py)
        name = f'pdserve_handoff_phase_seconds_{{}}{{{{phase={phase}}}}}'
        n = after.get(name.format("count"), 0.0) - before.get(name.format("count"), 0.0)
        total = after.get(name.format("sum"), 0.0) - before.get(name.format("sum"), 0.0)
        if n > 0:
            out[f"handoff_{phase}_mean_ms"] = round(1e3 * total / n, 2)
    for key, value in after.items():
        if key.startswith(COUNTERS):
            d = value - before.get(key, 0.0)
            if d:
                out[key] = d
    return out


# Cache figures only the controller can give (its route receipts, from the engines' own
# reports): prompt tokens the engines computed, KV bytes moved between workers, the prefix
# caches' hit rate on each side, handoffs skipped. None where the run has no such series.
CACHE_FIGURES = ("prompt_tokens_computed", "kv_bytes_moved", "prefill_cache_hit_rate",
                 "decode_cache_hit_rate", "handoffs_skipped")


def cache_figures(delta: dict[str, float]) -> dict[str, float | None]:
    """CACHE_FIGURES from a run's controller delta (see delta())."""
    def get(name: str, **labels: str) -> float:
        label = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        return delta.get(name + (f"{{{label}}}" if label else ""), 0.0)

    def share(part: float, whole: float) -> float | None:
        return round(part / whole, 4) if whole else None

    cached_p = get("pdserve_prefix_cached_tokens_total", side="prefill")
    cached_d = get("pdserve_prefix_cached_tokens_total", side="decode")
    computed_p = get("pdserve_prompt_tokens_computed_total", side="prefill")
    computed_d = get("pdserve_prompt_tokens_computed_total", side="decode")
    read = get("pdserve_kv_read_tokens_total")
    seen = cached_p + cached_d + computed_p + computed_d + read
    return {
        "prompt_tokens_computed": computed_p + computed_d if seen else None,
        "kv_bytes_moved": get("pdserve_kv_transfer_bytes_sum") if seen else None,
        "prefill_cache_hit_rate": share(cached_p, cached_p + computed_p),
        "decode_cache_hit_rate": share(cached_d, cached_d + read + computed_d),
        "handoffs_skipped": get("pdserve_routes_total", path="local", reason="cached")
        if seen else None,
    }


def nixl_reads(base_url: str, timeout: float = 5.0) -> tuple[float, float]:
    """(reads, bytes) vLLM's NIXL connector counted in the engine behind a plain vLLM server;
    (0, 0) before its first read or if it cannot be reached."""
    return parse_nixl_reads(metrics_text(base_url, timeout))


def parse_nixl_reads(text: str) -> tuple[float, float]:
    """From vLLM's `vllm:nixl_bytes_transferred` histogram (one observation per read), summed
    over its engines."""
    got = {"_count": 0.0, "_sum": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:nixl_bytes_transferred":
            for s in family.samples:
                if (end := s.name.removeprefix(family.name)) in got:
                    got[end] += s.value
    return got["_count"], got["_sum"]
