"""Means of the controller's own phase histograms over one run, from two /metrics scrapes."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# pdserve_<name>_seconds histograms and counters worth reporting next to the client's figures.
HISTOGRAMS = ("queue_time", "prefill_time", "kv_handoff", "time_to_first_token")
COUNTERS = ("pdserve_local_prefills_total", "pdserve_retries_total",
            "pdserve_requests_total", "pdserve_generation_tokens_total")


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


def scrape(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as r:
            return parse(r.read().decode())
    except OSError:
        return {}


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
    for key, value in after.items():
        if key.startswith(COUNTERS):
            d = value - before.get(key, 0.0)
            if d:
                out[key] = d
    return out


# Cache figures only the controller can give: KV bytes moved between workers, and the prefix
# cache's hit rate on each side. Reported as null ("-") until the controller exports them.
CACHE_FIGURES = ("kv_bytes_moved", "prefill_cache_hit_rate", "decode_cache_hit_rate")


def cache_figures(delta: dict[str, float]) -> dict[str, float | None]:
    """The hook for CACHE_FIGURES from a run's controller delta: fill each in here from the
    controller's series when they exist; never an estimate."""
    return dict.fromkeys(CACHE_FIGURES)
