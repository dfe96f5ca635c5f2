"""The Grafana dashboard (deploy/kubernetes/grafana/pdserve-dashboard.json).

It loads and its panels are well formed; every PromQL expression in it (panel queries, the
annotation, the variables' label_values) parses (tests/promql.py) and names only series that
exist: pdserve's, read from a controller's metrics registry (histograms with their _bucket,
_sum and _count, counters with _total), and vLLM's, read from the metric definitions of the
installed vLLM (0.32). The label names a query matches or groups on must be ones those series
carry, or ones Prometheus adds when it scrapes (namespace, instance, ...).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest
from promql import PromQLError, parse

from pdserve.controller.metrics import Metrics
from pdserve.controller.planning import Planning
from pdserve.controller.receipts import Route
from pdserve.controller.registry import Registry
from pdserve.planner.capacity import Slo
from pdserve.planner.roles import ROLES, RolePlanner
from pdserve.protocol import EngineInfo, Load, Register, Role

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "kubernetes" / "grafana" / "pdserve-dashboard.json"
# Labels a Prometheus scrape adds (target labels, Kubernetes service discovery's usual ones).
SCRAPE_LABELS = {"namespace", "instance", "job", "pod", "container", "service", "endpoint",
                 "node"}
# What Grafana puts in place of its interval variables before the query runs.
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|"
                               r"interval|range)\}")
# vLLM's metric definitions: its Prometheus stat logger, and the NIXL connector's (pdserve's).
VLLM_SOURCES = ("v1/metrics/loggers.py", "v1/metrics/perf.py", "v1/spec_decode/metrics.py",
                "distributed/kv_transfer/kv_connector/v1/nixl/stats.py")
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
             "histogram": ("_bucket", "_sum", "_count", "_created"), "summary": ("_sum", "_count")}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def pdserve_series() -> dict[str, set[str]]:
    """Each series name the controller exports -> its label names, from a registry in which
    every labelled family has been given a sample."""
    info = EngineInfo("m", "m", 16, "float32", "nixl", 4096)
    pool = Registry(info)
    pool.register(Register("d1", Role.DECODE, "h", info), b"d1")
    pool.heartbeat("d1", Load(1, 1, 0.5), False)
    m = Metrics()
    m.watch_pool(pool)
    planning = Planning(pool, RolePlanner(Slo(2000, 50)))
    m.watch_planning(planning)
    planning.desired = {role: 1 for role in ROLES}  # what a tick with an auto worker sets
    planning.on_change(pool.workers["d1"], "both", "decode", "steadier")
    t = m.timeline(4)
    t.prefill_started("p1")
    t.prefill_done(4)
    t.tokens(1)
    t.decode_started("d1")
    t.tokens(2)
    t.retried(migrated=True)
    t.retried(migrated=False)
    t.local("d1")
    t.routed(Route(tokens=10, path="disaggregated", prefill="p1", prefill_hit=4, decode="d1",
                   decode_hit=2, kv_read_tokens=8, kv_bytes=1024))
    t.handoff_phases({"kv_read": 0.001})
    t.finish("completed")
    m.rejected_no_worker("decode")
    m.rejected("queue_full")
    out: dict[str, set[str]] = {}
    for family in m.registry.collect():
        assert family.samples, f"{family.name}: no sample, so its labels are unknown here"
        labels = {k for s in family.samples for k in s.labels} - {"le"}
        name = family.name
        for suffix in _SUFFIXES[family.type]:
            out[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


@pytest.fixture(scope="module")
def vllm_series() -> set[str]:
    """The series names vLLM's engines export, from the installed vLLM's metric definitions
    (`self._counter_cls(name="vllm:...")` and the like)."""
    spec = importlib.util.find_spec("vllm")  # its files, without importing it
    assert spec is not None and spec.submodule_search_locations
    root = Path(spec.submodule_search_locations[0])
    kinds = {"_counter_cls": "counter", "_gauge_cls": "gauge", "_histogram_cls": "histogram"}
    out: set[str] = set()
    for rel in VLLM_SOURCES:
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in kinds):
                continue
            for kw in node.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    name = str(kw.value.value)
                    kind = kinds[node.func.attr]
                    if kind == "counter":  # prometheus_client's exposition adds _total once
                        name = name.removesuffix("_total")
                    out |= {name + s for s in _SUFFIXES[kind]}
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_bucket", "vllm:prompt_tokens_total",
            "vllm:nixl_xfer_time_seconds_bucket"} <= out, sorted(out)
    return out


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])  # the panels of a collapsed row
    return out


def queries(dash: dict) -> list[tuple[str, str, str]]:
    """(where, PromQL, legend) of every query: panel targets, annotations, variables."""
    out = []
    for p in panels(dash):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"], t.get("legendFormat", "")))
    for a in dash["annotations"]["list"]:
        if "expr" in a:
            out.append((f"annotation {a['name']!r}", a["expr"], a.get("textFormat", "")))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"])
            assert m, v["query"]
            out.append((f"variable {v['name']}", m[1], "{{" + m[2] + "}}"))
    return out


def substituted(expr: str) -> str:
    return GRAFANA_INTERVALS.sub("5m", expr)


def test_dashboard_loads_and_is_well_formed(dashboard):
    assert dashboard["uid"] == "pdserve" and dashboard["title"] == "pdserve"
    assert DASHBOARD.stat().st_size < 200_000  # `kubectl apply` keeps it in an annotation
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    titles = {p["title"] for p in panels(dashboard)}
    for wanted in ("Requests per second, by outcome", "Routes: local prefill or KV handoff",
                   "Time to first token p50 / p99", "Inter-token latency p50 / p99",
                   "KV handoff p50 / p99", "Running requests per worker",
                   "Waiting requests per worker", "KV-cache usage per worker",
                   "Engine KV-cache usage", "NIXL KV transfer time p50 / p99",
                   "Desired workers by role (role planner) and ready workers",
                   "Duty changes of auto workers per minute, by why"):
        assert wanted in titles, wanted
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    repeated = [r for r in rows if r.get("repeat")]
    assert [r["repeat"] for r in repeated] == ["worker"]  # a row per worker
    assert variables["worker"]["multi"] and variables["worker"]["includeAll"]
    for p in panels(dashboard):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
    # Every $variable a query uses is defined.
    for where, expr, _ in queries(dashboard):
        for name in re.findall(r"\$(\w+)", GRAFANA_INTERVALS.sub("", expr)):
            assert name in variables, (where, name)


def test_every_query_parses_and_names_exported_series(dashboard, pdserve_series, vllm_series):
    named: set[str] = set()
    for where, expr, legend in queries(dashboard):
        try:
            parsed = parse(substituted(expr))
        except PromQLError as e:
            pytest.fail(f"{where}: {e}")
        assert parsed.selectors, (where, expr)
        carried: set[str] = set(SCRAPE_LABELS)
        for s in parsed.selectors:
            assert s.metric is not None, (where, expr)
            named.add(s.metric)
            if s.metric.startswith("vllm:"):
                assert s.metric in vllm_series, f"{where}: vLLM exports no {s.metric}"
                continue  # vLLM builds its label names at run time: only names are checked
            assert s.metric in pdserve_series, f"{where}: pdserve exports no {s.metric}"
            labels = pdserve_series[s.metric] | SCRAPE_LABELS
            assert set(s.labels) <= labels, (where, s.metric, set(s.labels) - labels)
            carried |= labels
        if all(s.metric and s.metric.startswith("pdserve_") for s in parsed.selectors):
            assert parsed.grouping <= carried, (where, parsed.grouping - carried)
            shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
            assert shown <= (parsed.grouping or carried), (where, legend)
    # The board covers the controller's series (not the process's own).
    assert {n for n in pdserve_series if not n.endswith(("_created", "_sum"))} - named <= {
        "pdserve_time_per_output_token_seconds_count", "pdserve_e2e_request_latency_seconds_count",
        "pdserve_queue_time_seconds_count", "pdserve_time_to_first_token_seconds_count",
        "pdserve_inter_token_latency_seconds_count"}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket"} <= named


@pytest.mark.parametrize("expr, error", [
    ("sum(rate(pdserve_requests_total[5m])", "expected )"),
    ("rate(pdserve_requests_total[5])", "expected duration"),
    ("histogram_quantil(0.5, x)", "unknown function"),
    ('pdserve_requests_total{outcome="completed"', "expected }"),
    ("pdserve_requests_total{outcome=completed}", "expected string"),
    ("sum by (le (x)", "expected"),
    ("x +", "expected an expression"),
    ("x y", "trailing"),
])
def test_the_parser_rejects_malformed_queries(expr, error):
    with pytest.raises(PromQLError, match=re.escape(error)):
        parse(expr)


def test_the_checks_catch_a_wrong_name_or_label(pdserve_series):
    """The checks above are not a no-op: a misspelt series, a histogram without its _bucket,
    a label the series does not carry."""
    for expr in ("rate(pdserve_request_total[5m])",
                 "histogram_quantile(0.5, rate(pdserve_kv_handoff_seconds[5m]))"):
        (s,) = parse(expr).selectors
        assert s.metric not in pdserve_series
    (s,) = parse('pdserve_requests_total{kind="migration"}').selectors
    assert not set(s.labels) <= pdserve_series[s.metric] | SCRAPE_LABELS


# The pool as each controller sees it: every controller replica (and API server) reports every
# worker, so these come once per controller and must not be summed over them.
POOL_GAUGES = ("pdserve_worker_running_requests", "pdserve_worker_waiting_requests",
               "pdserve_worker_kv_usage_ratio", "pdserve_worker_heartbeat_age_seconds",
               "pdserve_pool_workers")


def test_the_pool_is_counted_once_however_many_controllers_report_it(dashboard):
    direct = re.compile(r"\b(sum|max|min|avg|count)\s*(?:by\s*\([^)]*\)\s*)?\(\s*("
                        + "|".join(POOL_GAUGES) + r")\b")
    found = []
    for where, expr, _ in queries(dashboard):
        for aggregation, name in direct.findall(expr):
            found.append(name)
            assert aggregation in ("max", "min", "avg"), (where, expr)
    assert set(found) == set(POOL_GAUGES)
    # Legs and requests are each controller's own: those add up. So do the role planner's
    # desired workers (each replica plans for the requests it carries, as the HPAs' adapter
    # rule sums them) and its duty changes (each replica sets duties in its own registry).
    exprs = [expr for _, expr, _ in queries(dashboard)]
    assert any(expr.startswith("sum(pdserve_worker_inflight_requests") for expr in exprs)
    assert 'sum by (role) (pdserve_planner_desired_workers{namespace=~"$namespace"})' in exprs
    assert any(expr.startswith("sum by (why) (rate(pdserve_role_changes_total{")
               for expr in exprs)
