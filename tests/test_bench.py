"""`pdserve bench`'s pure parts: workload, metrics, CPU accounting, configurations, report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from pdserve.bench import cluster, handoff, procs, report, scrape, workload
from pdserve.bench.client import ClientRun, client_args
from pdserve.bench.metrics import (
    Record,
    Slo,
    parse_slo,
    percentiles,
    records_from_vllm,
    summarize,
    summarize_by_class,
)

# ---- workload ------------------------------------------------------------------------------


def test_workload_is_deterministic_for_a_seed() -> None:
    a = workload.make_workload(workload.MIXED, 50, 1.0, 1.0, seed=7)
    b = workload.make_workload(workload.MIXED, 50, 1.0, 1.0, seed=7)
    c = workload.make_workload(workload.MIXED, 50, 1.0, 1.0, seed=8)
    assert a == b
    assert a != c


@pytest.mark.parametrize("n", [1, 7, 10, 333])
def test_mixed_workload_has_the_requested_mix(n: int) -> None:
    items = workload.make_workload(workload.MIXED, n, 2.0, 1.0, seed=0)
    long = [i for i in items if i.cls == "long"]
    short = [i for i in items if i.cls == "short"]
    assert len(long) + len(short) == n
    assert abs(len(long) - 0.3 * n) <= 0.5  # exact shares, rounded
    assert all(1500 <= i.input_len <= 2000 and i.output_len == 32 for i in long)
    assert all(90 <= i.input_len <= 110 and i.output_len == 128 for i in short)
    assert [i.index for i in items] == list(range(n))


def test_classes_are_shuffled_not_blocked() -> None:
    items = workload.make_workload(workload.MIXED, 100, 1.0, 1.0, seed=0)
    first_half_long = sum(i.cls == "long" for i in items[:50])
    assert 5 < first_half_long < 25


def test_class_counts_sum_and_round() -> None:
    classes = workload.parse_mix("1:10:1,1:10:1,1:10:1")
    assert workload.class_counts(classes, 10) == [4, 3, 3]
    assert sum(workload.class_counts(workload.MIXED, 999)) == 999


def test_parse_mix_and_uniform() -> None:
    (a, b) = workload.parse_mix("0.3:1500-2000:32, 0.7:100:128")
    assert (a.share, a.input_min, a.input_max, a.output_len) == (0.3, 1500, 2000, 32)
    assert (b.input_min, b.input_max) == (100, 100)
    for bad in ("", "0.3:10", "x:1-2:3", "0.5:20-10:4", "0:1-2:3"):
        with pytest.raises(ValueError):
            workload.parse_mix(bad)
    (u,) = workload.uniform(1000, 64, 0.1)
    assert (u.input_min, u.input_max, u.output_len) == (900, 1100, 64)


def test_poisson_arrivals_end_at_n_over_rate() -> None:
    times = workload.arrivals(400, 2.0, 1.0, np.random.default_rng(0))
    assert times == sorted(times)
    assert times[-1] == pytest.approx(200.0)
    gaps = np.diff([0.0, *times])
    assert gaps.mean() == pytest.approx(0.5, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.15)  # exponential: CV 1


def test_burstiness_shapes_the_gaps() -> None:
    def cv(b: float) -> float:
        gaps = np.diff([0.0, *workload.arrivals(2000, 1.0, b, np.random.default_rng(1))])
        return float(gaps.std() / gaps.mean())

    assert cv(0.25) > 1.5
    assert cv(4.0) < 1.0
    steady = workload.arrivals(4, 2.0, math.inf, np.random.default_rng(0))
    assert steady == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert workload.arrivals(3, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 3


def test_trace_has_unique_prompts_of_the_right_length(tmp_path: Path) -> None:
    items = workload.make_workload(workload.MIXED, 20, 1.0, 1.0, seed=0)
    ids: list[int] = []
    for run in (0, 1):
        path = workload.write_trace(items, tmp_path / f"t{run}.jsonl", run=run)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == 20
        for it, row in zip(items, rows):
            assert row["input_length"] == it.input_len
            assert row["output_length"] == it.output_len
            assert row["timestamp"] == pytest.approx(it.arrival, abs=1e-6)
            assert len(row["hash_ids"]) == math.ceil(it.input_len / workload.CHUNK)
            ids += row["hash_ids"]
    assert len(ids) == len(set(ids))  # no prefix shared between requests or runs


def test_vllm_client_reads_the_trace_as_exact_prompts(tmp_path: Path) -> None:
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")

    class Tok:
        all_special_ids: ClassVar[list[int]] = [0, 1]

        def get_vocab(self) -> dict[str, int]:
            return {f"t{i}": i for i in range(100)}

    items = workload.make_workload(workload.MIXED, 6, 1.0, 1.0, seed=3)
    path = workload.write_trace(items, tmp_path / "t.jsonl")
    trace = datasets.TimedTrace(dataset_path=str(path), timed_trace_label_timestamp="timestamp",
                                timed_trace_label_input_length="input_length",
                                timed_trace_label_output_length="output_length",
                                timed_trace_label_hash_ids="hash_ids")
    reqs = trace.sample(Tok(), 6)
    assert [r.prompt_len for r in reqs] == [it.input_len for it in items]
    assert [len(r.prompt) for r in reqs] == [it.input_len for it in items]
    assert [r.expected_output_len for r in reqs] == [it.output_len for it in items]
    assert all(t not in (0, 1) for r in reqs for t in r.prompt)


def test_client_arguments_parse_with_vllms_parser(tmp_path: Path) -> None:
    serve = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    run = ClientRun("http://127.0.0.1:1", "/m", tmp_path / "t.jsonl", 5, tmp_path / "r.json",
                    Slo(2000, 18), max_concurrency=1)
    a = parser.parse_args(client_args(run))
    assert (a.dataset_name, a.self_timed, a.num_prompts, a.save_detailed) == (
        "timed_trace", True, 5, True)
    assert a.goodput == ["ttft:2000", "tpot:18"] and a.max_concurrency == 1

# ---- metrics -------------------------------------------------------------------------------


def _records() -> list[Record]:
    # ttft, e2e in seconds; itl gaps; output tokens.
    return [
        Record(100, 11, ttft=0.1, e2e=0.2, itl=[0.01] * 10, cls="short"),  # tpot 10 ms
        Record(100, 11, ttft=0.3, e2e=0.5, itl=[0.02] * 10, cls="short"),  # tpot 20 ms
        Record(2000, 3, ttft=2.5, e2e=2.53, itl=[0.015, 0.015], cls="long"),  # ttft over SLO
        Record(2000, 1, ttft=1.0, e2e=1.0, cls="long"),  # one token: tpot counts as 0
        Record(50, 0, ttft=0.0, e2e=0.0, error="boom", cls="short"),  # failed
    ]


def test_tpot_definition() -> None:
    r = _records()
    assert r[0].tpot == pytest.approx(0.01)
    assert r[2].tpot == pytest.approx(0.015)
    assert r[3].tpot is None
    assert not r[4].ok


def test_percentiles_interpolate_like_numpy() -> None:
    p = percentiles([0.001, 0.002, 0.003, 0.004])
    assert p["p50"] == pytest.approx(2.5)
    assert p["p90"] == pytest.approx(3.7)
    assert p["p99"] == pytest.approx(3.97)
    assert p["mean"] == pytest.approx(2.5)
    assert math.isnan(percentiles([])["p50"])


def test_summary_goodput_and_latencies() -> None:
    s = summarize(_records(), duration=2.0, slo=Slo(ttft_ms=2000, tpot_ms=18))
    assert (s["requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["goodput"] == pytest.approx(2 / 2.0)  # records 0 and 3 meet both
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["request_throughput"] == pytest.approx(4 / 2.0)
    assert s["output_throughput"] == pytest.approx(26 / 2.0)
    assert s["ttft"]["p50"] == pytest.approx(650.0)  # median of 100, 300, 1000, 2500 ms
    assert s["tpot"]["p50"] == pytest.approx(15.0)  # 10, 15, 20 ms
    assert s["itl"]["p50"] == pytest.approx(15.0)  # 10 x 10 ms, 10 x 20 ms, 2 x 15 ms
    assert s["e2e"]["p99"] == pytest.approx(np.percentile([200, 500, 2530, 1000], 99))
    loose = summarize(_records(), 2.0, Slo(ttft_ms=3000, tpot_ms=None))
    assert loose["goodput"] == pytest.approx(4 / 2.0)


def test_pauses_show_the_gaps_itl_p99_hides() -> None:
    from pdserve.bench.metrics import pauses

    # 100 streams of 100 steady 10 ms gaps; one stream paused 300 ms once (0.01% of the gaps),
    # and every stream's first gap (a KV handoff) 60 ms.
    recs = [Record(100, 101, ttft=0.1, e2e=1.1, itl=[0.06] + [0.01] * 99) for _ in range(100)]
    recs[7].itl[50] = 0.3
    p = pauses(recs)
    assert percentiles([g for r in recs for g in r.itl], (99,))["p99"] == pytest.approx(60.0)
    assert p["itl_max_ms"] == pytest.approx(300.0)
    assert p["gaps_paused"] == pytest.approx(1 / 10_000)
    assert p["requests_paused"] == pytest.approx(1 / 100)
    assert p["worst_gap_p90_ms"] == pytest.approx(60.0)
    assert p["later_itl_max_ms"] == pytest.approx(300.0)
    assert p["itl_p99.9_ms"] == pytest.approx(60.0)  # the handoff gaps are 1% of all gaps
    assert p["later_itl_p99.9_ms"] == pytest.approx(10.0)
    assert p["first_gap_p99_ms"] == pytest.approx(60.0)
    assert p["first_gap_p50_steps"] == pytest.approx(6.0)  # in the later gaps' p50, 10 ms
    assert pauses([Record(1, 1, ttft=0.1, e2e=0.1)]) == {}


def test_summary_by_class() -> None:
    by = summarize_by_class(_records(), 2.0, Slo())
    assert set(by) == {"long", "short"}
    assert (by["short"]["requests"], by["short"]["failed"]) == (3, 1)
    assert by["long"]["ttft"]["p50"] == pytest.approx(1750.0)


def test_parse_slo() -> None:
    assert parse_slo(["ttft:2000 tpot:18"]) == Slo(2000, 18, None)
    assert parse_slo(["ttft:500", "e2el:9000"]) == Slo(500, None, 9000)
    assert parse_slo([]) == Slo()
    with pytest.raises(ValueError):
        parse_slo(["itl:5"])
    assert Slo(2000, 18).label() == "ttft:2000 tpot:18"


def test_records_from_a_vllm_result() -> None:
    result = {"input_lens": [10, 20], "output_lens": [3, 0], "ttfts": [0.1, 0.0],
              "itls": [[0.01, 0.02], []], "latencies": [0.13, 0.0], "start_times": [5.0, 6.0],
              "errors": ["", "Bad Gateway"]}
    a, b = records_from_vllm(result, ["x", "y"])
    assert (a.input_len, a.output_len, a.ttft, a.e2e, a.itl, a.cls) == (
        10, 3, 0.1, 0.13, [0.01, 0.02], "x")
    assert a.ok and not b.ok and b.error == "Bad Gateway"
    del result["latencies"]
    assert records_from_vllm(result)[0].e2e == pytest.approx(0.13)

# ---- CPU accounting, configurations, controller metrics ------------------------------------


def test_parse_stat_handles_odd_command_names() -> None:
    fields = ["S", "1", "4242"] + ["0"] * 8 + [str(3 * procs.TICKS), str(procs.TICKS)]
    pid, pgrp, cpu = procs.parse_stat("77 (VLLM::) Worker) " + " ".join(fields + ["0"] * 30))
    assert (pid, pgrp, cpu) == (77, 4242, pytest.approx(4.0))


def test_group_cpu_sums_each_group(tmp_path: Path) -> None:
    def proc(pid: int, pgrp: int, ticks: int, ppid: int = 1) -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        rest = ["S", str(ppid), str(pgrp)] + ["0"] * 8 + [str(ticks), "0"] + ["0"] * 30
        (d / "stat").write_text(f"{pid} (python3) " + " ".join(rest))

    proc(10, 10, procs.TICKS)
    proc(11, 10, procs.TICKS * 2, ppid=10)
    proc(20, 20, procs.TICKS)
    # An engine core in a group of its own below worker 11, and its own child.
    proc(30, 30, procs.TICKS * 4, ppid=11)
    proc(31, 30, procs.TICKS * 8, ppid=30)
    (tmp_path / "self").mkdir()
    assert procs.group_cpu([10, 99], proc=tmp_path) == {10: pytest.approx(15.0), 99: 0.0}
    assert procs.group_cpu([10, 30], proc=tmp_path) == {10: pytest.approx(3.0),
                                                        30: pytest.approx(12.0)}
    assert procs.group_pids(10, proc=tmp_path) == [10, 11]


def test_machine_cpu_counts_busy_time_only(tmp_path: Path) -> None:
    t = procs.TICKS
    # user nice system idle iowait irq softirq steal
    (tmp_path / "stat").write_text(f"cpu  {t} {t} {t} {50 * t} {7 * t} {t} 0 {t} 0 0\n"
                                   "cpu0 1 1 1 1 1 1 1 1 0 0\n")
    assert procs.machine_cpu(proc=tmp_path) == pytest.approx(5.0)


def test_parse_configs() -> None:
    cfgs = cluster.parse_configs("1P1D, 2p1d ,colocated")
    assert [c.name for c in cfgs] == ["1P1D", "2P1D", "colocated"]
    assert cfgs[1].roles() == ["prefill", "prefill", "decode"]
    assert cfgs[2].both == 3 and cfgs[2].colocated  # as many engines as the largest XpYd
    assert cluster.parse_configs("colocated")[0].both == 2
    assert cluster.parse_configs("colocated4")[0].engines == 4
    assert cfgs[0].local_threshold is None  # the controller's default
    pure = cluster.parse_configs("1P1D@0,colocated")
    assert pure[0].name == "1P1D@0" and pure[0].local_threshold == 0
    assert pure[1].both == 2 and not pure[0].decode_first
    routed = cluster.parse_configs("1P2D@256:kv,1P2D:blind")
    assert [(c.name, c.routing, c.local_threshold) for c in routed] == [
        ("1P2D@256:kv", "kv", 256), ("1P2D:blind", "blind", None)]
    held = cluster.parse_configs("1P1D@0:decode-first")[0]
    assert (held.name, held.local_threshold, held.decode_first) == ("1P1D@0:decode-first", 0, True)
    for bad in ("1P", "0P1D", "mixed", "1P1D@", "1P1D@x", "colocated@0", "1P1D:decode"):
        with pytest.raises(ValueError):
            cluster.parse_configs(bad)


def test_controller_phase_means_from_two_scrapes() -> None:
    def text(n: int, total: float, local: int) -> str:
        return ("# TYPE pdserve_kv_handoff_seconds histogram\n"
                f'pdserve_kv_handoff_seconds_bucket{{le="+Inf"}} {n}\n'
                f"pdserve_kv_handoff_seconds_count {n}\npdserve_kv_handoff_seconds_sum {total}\n"
                "# TYPE pdserve_local_prefills counter\n"
                f"pdserve_local_prefills_total {local}\n"
                "# TYPE pdserve_kv_reads counter\n"
                f'pdserve_kv_reads_total{{mode="in_step"}} {2 * local}\n'
                'pdserve_kv_reads_total{mode="own_step"} 1\n')

    d = scrape.delta(scrape.parse(text(2, 0.5, 1)), scrape.parse(text(6, 1.3, 4)))
    assert d["kv_handoff_mean_ms"] == pytest.approx(200.0)
    assert d["kv_handoff_count"] == 4
    assert d["pdserve_local_prefills_total"] == 3
    assert d["pdserve_kv_reads_total{mode=in_step}"] == 6
    assert "pdserve_kv_reads_total{mode=own_step}" not in d  # none during the run

# ---- report --------------------------------------------------------------------------------


def _results(records: dict[tuple[str, float], list[Record]]) -> dict:
    configs: dict = {}
    for (name, rate), recs in records.items():
        cfg = configs.setdefault(name, {"runs": [], "cores": {"w": "0"},
                                        "idle_cpu": {"w": {"cpu_s": 0.2, "wall_s": 20.0,
                                                           "core_pct": 1.0}}})
        cfg["runs"].append({"rate": rate, "summary": summarize(recs, 10.0, Slo()),
                            "by_class": summarize_by_class(recs, 10.0, Slo()),
                            "cpu": {"w": {"cpu_s": 5.0, "core_pct": 50.0}},
                            "controller": {"kv_handoff_mean_ms": 12.0,
                                           "handoff_kv_read_mean_ms": 3.5,
                                           "pdserve_kv_reads_total{mode=in_step}": 7.0}})
    return {"meta": {"slo": "ttft:2000 tpot:18", "command": "pdserve bench"}, "configs": configs}


def test_report_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    good = _records()
    slow = [Record(r.input_len, r.output_len, r.ttft * 3, r.e2e * 3, [g * 3 for g in r.itl],
                   cls=r.cls, error=r.error) for r in good]
    records = {("1P1D", 0.5): good, ("1P1D", 1.0): good[:3], ("colocated", 0.5): slow,
               ("colocated", 1.0): slow}
    results = _results(records)
    paths = report.write_report(results, records, tmp_path / "out")
    names = {p.name for p in paths}
    assert names == {"results.json", "report.md", "latency_cdf.png", "goodput.png"}
    for p in paths:
        assert p.stat().st_size > 0
    for png in ("latency_cdf.png", "goodput.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = json.loads((tmp_path / "out" / "results.json").read_text())
    assert loaded["configs"]["1P1D"]["runs"][0]["summary"]["completed"] == 4
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| 1P1D | 0.5 | 4 / 1 |" in md
    assert "| colocated | 1 | 4 / 1 |" in md
    assert "## Against the colocated baseline" in md
    assert "| 3.5 | - | - | 7 / 0 |" in md  # kv_read, first_step, worker_out, the reads


def test_comparison_uses_each_configurations_best_goodput() -> None:
    results = {"configs": {
        "1P1D": {"runs": [{"rate": 1.0, "summary": {"goodput": 0.9, "itl": {"p99": 30.0}}},
                          {"rate": 2.0, "summary": {"goodput": 1.5, "itl": {"p99": 60.0}}}]},
        "colocated": {"runs": [{"rate": 1.0, "summary": {"goodput": 1.0, "itl": {"p99": 200.0}}},
                               {"rate": 2.0, "summary": {"goodput": 0.5, "itl": {"p99": 900.0}}}]},
    }}
    rows = report.comparison(results)
    assert rows[2] == "| 1P1D | 2 | 1.50 | 1.50x | 60.0 | 0.30x |"
    assert rows[3] == "| colocated | 1 | 1.00 | 1.00x | 200 | 1.00x |"


def test_nan_becomes_null_in_json(tmp_path: Path) -> None:
    results = {"meta": {}, "configs": {"x": {"runs": [{"rate": 1.0, "summary": summarize(
        [], 1.0, Slo())}]}}}
    report.write_report(results, {}, tmp_path)
    loaded = json.loads((tmp_path / "results.json").read_text())
    assert loaded["configs"]["x"]["runs"][0]["summary"]["ttft"]["p50"] is None
    assert "| x | 1 | 0 / 0 | - / - / - |" in (tmp_path / "report.md").read_text()


def test_a_spawned_child_keeps_to_the_cpus_it_was_given(tmp_path: Path) -> None:
    import os
    import sys

    class Bare(cluster.Deployment):
        def start(self, timeout: float = 600.0) -> str:
            return ""

    core = max(os.sched_getaffinity(0))
    code = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)), flush=True); "
            "subprocess.run([sys.executable, '-c', "
            "'import os; print(sorted(os.sched_getaffinity(0)))'])")
    with Bare(tmp_path / "logs") as dep:
        child = dep.spawn("probe", [sys.executable, "-c", code], dict(os.environ), {core})
        assert child.proc.wait(60) == 0
        assert child.proc.pid in dep.groups().values()
    lines = (tmp_path / "logs" / "probe.log").read_text().split()
    assert lines == [f"[{core}]", f"[{core}]"]  # the child and its own children


def test_report_subcommand_recomputes_summaries_from_the_saved_client_results(
        tmp_path: Path) -> None:
    from pdserve.bench.main import main as bench_main

    recs = _records()
    raw = {"ttfts": [r.ttft for r in recs], "itls": [r.itl for r in recs],
           "latencies": [r.e2e for r in recs], "input_lens": [r.input_len for r in recs],
           "output_lens": [r.output_len for r in recs], "start_times": [0.0] * len(recs),
           "errors": [r.error for r in recs]}
    out = tmp_path / "res"
    (out / "raw").mkdir(parents=True)
    (out / "raw" / "1P1D-r1.json").write_text(json.dumps(raw))
    stale = {"completed": 0, "failed": 0, "requests": 0}  # e.g. written by an older pdserve
    results = {"meta": {"slo": "ttft:2000 tpot:18"}, "configs": {"1P1D": {"runs": [
        {"rate": 1.0, "duration": 2.0, "raw": "raw/1P1D-r1.json", "summary": stale}]}}}
    (out / "results.json").write_text(json.dumps(results))
    assert bench_main(["report", str(out)]) == 0
    s = json.loads((out / "results.json").read_text())["configs"]["1P1D"]["runs"][0]["summary"]
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["goodput"] == pytest.approx(1.0)  # as summarize() over the same records
    assert "## Pauses in the streams" in (out / "report.md").read_text()
    assert bench_main(["report"]) == 2


def test_cache_figures_come_from_the_controllers_receipt_counters() -> None:
    from pdserve.bench import scrape

    text = "\n".join([
        'pdserve_prefix_cached_tokens_total{side="prefill"} 600',
        'pdserve_prefix_cached_tokens_total{side="decode"} 900',
        'pdserve_prompt_tokens_computed_total{side="prefill"} 400',
        'pdserve_prompt_tokens_computed_total{side="decode"} 100',
        "pdserve_kv_read_tokens_total 500",
        "pdserve_kv_transfer_bytes_sum 65536",
        "pdserve_kv_transfer_bytes_count 4",
        'pdserve_routes_total{path="local",reason="cached"} 3',
    ]) + "\n"
    got = scrape.cache_figures(scrape.delta({}, scrape.parse(text)))
    assert got == {"prompt_tokens_computed": 500, "kv_bytes_moved": 65536,
                   "prefill_cache_hit_rate": 0.6, "decode_cache_hit_rate": 0.6,
                   "handoffs_skipped": 3}


def test_handoff_report_compares_each_round_with_its_own_vllm_run():
    def row(gap: float, itl: float) -> dict:
        return {"requests": 15, "ok": 15, "ttft_p50_ms": 20.0, "first_gap_p50_ms": gap,
                "first_gap_p99_ms": gap, "itl_after_p50_ms": itl, "itl_all_p50_ms": itl,
                "e2e_p50_ms": 400.0, "phases_ms": {"kv_read": 3.0}}

    # The machine ran twice as fast in round 2: each ratio is against the vLLM run beside it.
    rounds = [{"vllm": {300: row(6.0, 6.0)}, "pdserve": {300: row(18.0, 6.6)}},
              {"vllm": {300: row(3.0, 3.0)}, "pdserve": {300: row(9.0, 3.3)}}]
    text = handoff.markdown({"command": "c", "model": "m", "workload": "w", "rounds": rounds})
    one, two = text.split("## Round 2")
    assert "## Round 1" in one
    for part in (one, two):
        cells = [c.strip() for c in part.split("\n| 300 |")[1].split("\n")[0].split("|")]
        assert cells[3] == "3.00" and cells[5] == "1.10"  # gap in steps, ITL x vLLM's


def test_handoff_systems_take_turns_with_the_same_prompts(tmp_path, monkeypatch):
    """ABBA turns of --interleave requests, the same prompts for both; each turn's ITL ratio is
    against the other system's turn beside it, so a machine slowing down half-way (both see it)
    leaves the ratios alone."""
    calls: list[tuple[str, list[int]]] = []
    step = {"vllm": 0.002, "pd": 0.0022}

    def fake_client(run, log, seed=0):
        assert run.cores == {0}  # the prefill core: the decode core is the engine's
        ids = [json.loads(line)["hash_ids"][0] for line in run.trace.read_text().splitlines()]
        calls.append((run.base_url.removeprefix("http://"), ids))
        n, s = len(ids), step[calls[-1][0]] * (2 if len(calls) > 6 else 1)
        return {"ttfts": [0.01] * n, "itls": [[0.008] + [s] * 9] * n, "input_lens": [300] * n,
                "output_lens": [10] * n, "start_times": [0.0] * n, "errors": [""] * n}

    class Dep:
        def __init__(self, url):
            self.base_url = url

    monkeypatch.setattr(handoff, "run_client", fake_client)
    monkeypatch.setattr(procs, "wait_quiet", lambda *a: 0.0)
    monkeypatch.setattr(scrape, "scrape", lambda url: {})
    args = handoff.make_parser().parse_args(["--prompts", "10", "--interleave", "3"])
    (tmp_path / "raw").mkdir()
    res = handoff.measure({"vllm": Dep("http://vllm"), "pdserve": Dep("http://pd")}, [300],
                          args, "m", tmp_path)
    assert [url for url, _ in calls] == ["vllm", "pd"] + ["vllm", "pd", "pd", "vllm"] * 2
    turns = [ids for _, ids in calls[2:]]  # after a warm-up each
    assert all(turns[k] == turns[k + 1] for k in range(0, 8, 2))
    assert [len(t) for t in turns[::2]] == [3, 3, 3, 1]
    assert len({i for t in turns for i in t}) == 10
    pd = res["pdserve"][300]
    assert pd["ok"] == 10 and res["vllm"][300]["ok"] == 10
    assert pd["itl_x_vllm_per_turn"] == [1.1] * 4
    assert handoff.per_turn(pd) == "1.10 (1.10-1.10)"


def test_handoff_rounds_start_the_systems_in_turn_reversed_order(tmp_path, monkeypatch):
    """Round 2 starts the systems (and gives the first turn) in the reverse of round 1's order,
    so whatever a deployment's start gives it does not always fall to the same system."""
    started: list[list[str]] = []

    class Dep:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def start(self, timeout):
            started[-1].append(self.name)

    def fake_measure(deps, lengths, args, model, out):
        assert list(deps) == started[-1]  # turns in the order they started
        return {name: {} for name in deps}

    monkeypatch.setattr(handoff, "deployment", lambda name, *a: Dep(name))
    monkeypatch.setattr(handoff, "measure", fake_measure)
    args = handoff.make_parser().parse_args(["--router", "--rounds", "3"])
    for r in range(3):
        started.append([])
        handoff.measure_round(args, "m", [300], [0, 1], tmp_path / f"round{r}", r)
    assert started == [["vllm", "pdserve", "router"], ["router", "pdserve", "vllm"],
                       ["vllm", "pdserve", "router"]]


def test_a_bench_childs_temporary_files_go_to_the_runs_folder(tmp_path: Path) -> None:
    """vLLM's server makes a `vllm_dist_*` file where tempfile points, and leaves it there."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                         env=cluster.bench_env(tmp_path), capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == str(tmp_path)


def test_the_router_baselines_servers_run_pdserves_connector_in_their_roles(tmp_path,
                                                                           monkeypatch):
    """P then D through vllm-router: the prefill server on the first core, the decode server on
    the second, each with pdserve's CPU connector in a worker's role and the environment a
    worker gives its engine (cma then TCP, side channels on ports of their own), nothing that
    names a pdserve worker."""
    from pdserve.worker.engine import CPU_CONNECTOR
    from pdserve.worker.stop_signals import ENGINE_OWN_GROUP_ENV

    monkeypatch.setattr(cluster, "is_cpu_host", lambda: True)
    monkeypatch.delenv("UCX_TLS", raising=False)
    dep = cluster.RouterDeployment("m", tmp_path, [3, 5])
    got, side_channels = [], set()
    for server in dep.servers:
        cmd = server.command(8000)
        config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        env = server.environment(tmp_path)
        got.append((config["kv_connector"], config["kv_role"], env["VLLM_CPU_OMP_THREADS_BIND"],
                    env["UCX_TLS"], ENGINE_OWN_GROUP_ENV in env))
        side_channels.add(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    assert len(side_channels) == 2
    assert got == [(CPU_CONNECTOR, "kv_producer", "3", "cma,tcp", False),
                   (CPU_CONNECTOR, "kv_consumer", "5", "cma,tcp", False)]
    assert "--kv-transfer-config" not in cluster.VllmDeployment("m", tmp_path).command(8000)


def test_nixl_reads_come_from_vllms_histogram_summed_over_engines():
    text = "\n".join([
        "# TYPE vllm:nixl_bytes_transferred histogram",
        'vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="m"} 3.0',
        'vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 3.0',
        'vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 1500000.0',
        'vllm:nixl_bytes_transferred_count{engine="1",model_name="m"} 1.0',
        'vllm:nixl_bytes_transferred_sum{engine="1",model_name="m"} 500000.0', ""])
    assert scrape.parse_nixl_reads(text) == (4.0, 2000000.0)
    assert scrape.parse_nixl_reads("") == (0.0, 0.0)


def test_handoff_counts_the_routers_reads_and_sets_pdserve_beside_it(tmp_path, monkeypatch):
    """With --router the bench counts the reads of the router's decode engine over each length's
    measured requests (every prompt handed over, as pdserve's are) and reports TTFT, the first
    gap and E2E beside pdserve's."""
    def fake_client(run, log, seed=0):
        n = len(run.trace.read_text().splitlines())
        router = "router" in run.base_url
        first, ttft = (0.004, 0.030) if router else (0.010, 0.022)
        return {"ttfts": [ttft] * n, "itls": [[first] + [0.004] * 9] * n,
                "input_lens": [300] * n, "output_lens": [10] * n, "start_times": [0.0] * n,
                "errors": [""] * n}

    counts = iter([(5.0, 1e6), (15.0, 4e6)])  # before and after the measured requests
    monkeypatch.setattr(handoff, "run_client", fake_client)
    monkeypatch.setattr(procs, "wait_quiet", lambda *a: 0.0)
    monkeypatch.setattr(scrape, "scrape", lambda url: {})
    monkeypatch.setattr(scrape, "nixl_reads", lambda url: next(counts))

    class Dep:
        base_url = "http://pd"

    router = cluster.RouterDeployment("m", tmp_path, [0, 1])
    router.base_url, router.servers[1].base_url = "http://router", "http://router-decode"
    args = handoff.make_parser().parse_args(["--prompts", "10", "--router"])
    (tmp_path / "raw").mkdir()
    res = handoff.measure({"pdserve": Dep(), "router": router}, [300], args, "m", tmp_path)
    assert res["router"][300]["kv_reads"] == 10 and res["router"][300]["kv_read_mb"] == 3.0
    text = handoff.markdown({"command": "c", "model": "m", "workload": "w", "rounds": [res]})
    row = [c.strip() for c in text.split("vllm-router")[1].split("\n| 300 |")[1]
           .split("\n")[0].split("|")]
    assert row[:3] == ["22.0 / 30.0", "10.0 / 4.0", "4.0 / 4.0"]  # TTFT, first gap, ITL after
    assert row[3:6] == ["68.0 / 70.0", "0.97", "10 of 10 (3.0)"]  # E2E, x the router's, reads
