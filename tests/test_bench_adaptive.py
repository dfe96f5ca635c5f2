"""`pdserve bench` for adaptive P/D: Nauto configurations, rate schedules (piecewise arrivals,
per-segment summaries) and the auto workers' duty timeline. Pure parts only: no engine."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.bench import cluster, duties, loads, report, workload
from pdserve.bench.duties import Change, DutyPoller, Sample
from pdserve.bench.main import main as bench_main
from pdserve.bench.duties import run_zero
from pdserve.bench.main import make_parser, paces_of
from pdserve.bench.metrics import (
    Record,
    Slo,
    clock_zero,
    split_by_start,
    summarize,
    summarize_segments,
)
from pdserve.bench.workload import Schedule, Segment

SCHEDULE = Schedule((Segment(1.0, 60.0), Segment(6.0, 60.0), Segment(2.0, 60.0)))

# ---- configurations ------------------------------------------------------------------------


def test_nauto_is_n_workers_of_role_auto_and_the_other_specs_are_unchanged() -> None:
    cfgs = cluster.parse_configs("1P1D@0,colocated,2auto,1P2D:kv")
    assert [c.name for c in cfgs] == ["1P1D@0", "colocated", "2auto", "1P2D:kv"]
    auto = cfgs[2]
    assert auto.roles() == ["auto", "auto"] and auto.engines == 2
    assert not auto.colocated and auto.local_threshold is None and auto.routing == ""
    assert cfgs[0].roles() == ["prefill", "decode"] and cfgs[0].local_threshold == 0
    assert cfgs[1].both == 3  # as many engines as the largest listed (1P2D)
    assert cluster.parse_configs("3AUTO,colocated")[1].both == 3  # an auto pool counts too
    for bad in ("0auto", "auto", "2auto@0", "2auto:kv", "2autos"):
        with pytest.raises(ValueError, match=bad):
            cluster.parse_configs(f"1P1D,{bad}")


def test_a_bad_config_or_rate_is_an_argparse_error_naming_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        make_parser().parse_args(["--configs", "1P1D,2auto,3X"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "pdserve bench: error: argument --configs: unknown configuration '3X'" in err
    assert "Nauto" in err
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--rates", "1:60,6:x"])
    assert "argument --rates: bad schedule segment '6:x'" in capsys.readouterr().err
    args = make_parser().parse_args(["--configs", "2auto", "--rates", "1:60,6:60"])
    assert [c.name for c in args.configs] == ["2auto"]
    assert args.rates == Schedule((Segment(1.0, 60.0), Segment(6.0, 60.0)))
    assert make_parser().parse_args([]).rates == [1.0, 2.0, 4.0]  # the default, parsed


def _controller(cfg: str, tmp_path: Path, auto_args: list[str]) -> list[str]:
    dep = cluster.PdDeployment(cluster.parse_configs(cfg)[0], "/m", tmp_path, keys=False,
                               controller_args=["--x=y"], auto_args=auto_args)
    return dep.controller_command(8000, 8001, None)


def test_an_auto_controller_aims_at_the_benchs_slo_with_the_profile(tmp_path: Path) -> None:
    planner = cluster.planner_args(Slo(2000.0, 18.0), "/p/profile.json",
                                   "--plan-interval 2 --plan-hold 5")
    assert planner == ["--slo", "ttft:2000", "tpot:18", "--profile", "/p/profile.json",
                       "--plan-interval", "2", "--plan-hold", "5"]
    ctl = _controller("2auto", tmp_path, planner)
    assert " ".join(planner) in " ".join(ctl)
    assert "--local-prefill-threshold" not in ctl  # the controller decides
    assert ctl[-1] == "--x=y"  # --controller-arg still comes last
    # Other configurations never get the planner's arguments.
    for other in ("1P1D@0", "colocated"):
        assert "--slo" not in _controller(other, tmp_path, planner)
    assert cluster.planner_args(Slo(None, 30.0, 5000.0)) == ["--slo", "tpot:30"]
    assert cluster.planner_args(Slo(None, None, 5000.0)) == []


def test_slo_configurations_place_by_the_slo_with_the_planners_arguments(
        tmp_path: Path) -> None:
    cfgs = cluster.parse_configs("1P1D:slo,2auto:SLO,1P2D@0:kv:slo")
    assert [c.name for c in cfgs] == ["1P1D:slo", "2auto:slo", "1P2D@0:kv:slo"]
    assert [c.slo_placement for c in cfgs] == [True, True, True]
    assert cfgs[2].local_threshold == 0 and cfgs[2].routing == "kv"
    planner = cluster.planner_args(Slo(2000.0, 18.0))
    for cfg in ("1P1D:slo", "2auto:slo"):
        ctl = _controller(cfg, tmp_path, planner)
        assert ctl[ctl.index("--placement") + 1] == "slo"
        assert ctl[ctl.index("--slo") + 1:ctl.index("--slo") + 3] == ["ttft:2000", "tpot:18"]
    assert "--placement" not in _controller("2auto", tmp_path, planner)
    for bad in ("1P1D:slo:kv", "2auto:slo:slo", "colocated:slo"):
        with pytest.raises(ValueError, match=bad):
            cluster.parse_configs(bad)


def test_an_auto_worker_is_started_with_role_auto() -> None:
    cmd = cluster.real_worker("auto", "tcp://127.0.0.1:1", "0", None, "/m", [])
    assert cmd[cmd.index("--role") + 1] == "auto"


# ---- schedules -----------------------------------------------------------------------------


def test_rates_are_separate_runs_or_one_schedule() -> None:
    assert workload.parse_rates("1, 2,4,6") == [1.0, 2.0, 4.0, 6.0]
    s = workload.parse_rates("1:60,6:60,2:60")
    assert s == SCHEDULE
    assert isinstance(s, Schedule)
    assert [seg.count for seg in s.segments] == [60, 360, 120]
    assert (s.count, s.seconds, s.starts()) == (540, 180.0, [0.0, 60.0, 120.0])
    assert s.mean_rate == pytest.approx(3.0)
    assert s.label() == "1:60,6:60,2:60"
    assert workload.run_tag(s) == "s1x60-6x60-2x60" and workload.run_tag(4.0) == "r4"
    assert workload.parse_rates("0:30,4:30") == Schedule((Segment(0, 30), Segment(4, 30)))


@pytest.mark.parametrize(("spec", "named"), [
    ("", "no rates"), ("1,6:60", "mixes"), ("x", "'x'"), ("0", "'0'"), ("-1", "'-1'"),
    ("6:x", "'6:x'"), ("6:0", "'6:0'"), ("-1:10", "'-1:10'"), ("6:60:2", "'6:60:2'"),
    ("inf:10", "'inf:10'"), ("0:60", "sends no request"),
])
def test_bad_rates_say_which_part_is_wrong(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        workload.parse_rates(spec)


def _in_segments(times: list[float], schedule: Schedule) -> list[int]:
    starts = schedule.starts()
    ends = [*starts[1:], schedule.seconds]
    return [sum(s < t < e for t in times) for s, e in zip(starts, ends)]


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0, math.inf])
def test_piecewise_arrivals_keep_each_segments_count_inside_it(burstiness: float) -> None:
    times = workload.piecewise_arrivals(SCHEDULE, burstiness, np.random.default_rng(3))
    assert times == sorted(times) and len(times) == SCHEDULE.count
    assert _in_segments(times, SCHEDULE) == [60, 360, 120]
    again = workload.piecewise_arrivals(SCHEDULE, burstiness, np.random.default_rng(3))
    assert times == again


def test_piecewise_arrivals_are_poisson_within_a_segment() -> None:
    long = Schedule((Segment(2.0, 30.0), Segment(10.0, 300.0)))
    times = workload.piecewise_arrivals(long, 1.0, np.random.default_rng(0))
    busy = [t for t in times if t > 30.0]
    gaps = np.diff(busy)
    assert gaps.mean() == pytest.approx(0.1, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)  # exponential: CV 1
    # Each half of the busy segment holds about half its arrivals (a constant rate inside).
    assert sum(t < 180.0 for t in busy) == pytest.approx(1500, rel=0.05)
    steady = workload.piecewise_arrivals(Schedule((Segment(3.0, 1.0),)), math.inf,
                                         np.random.default_rng(0))
    assert steady == pytest.approx([0.25, 0.5, 0.75])
    idle = Schedule((Segment(0.0, 20.0), Segment(1.0, 10.0)))
    assert min(workload.piecewise_arrivals(idle, 1.0, np.random.default_rng(0))) > 20.0


def _trace_load(tmp_path: Path, *argv: str) -> loads.Load:
    return loads.from_args(make_parser().parse_args(list(argv)), str(tmp_path), Slo())


def test_a_trace_load_retimes_the_same_requests_to_the_schedule(tmp_path: Path) -> None:
    load = _trace_load(tmp_path)
    assert isinstance(load, loads.TraceLoad) and load.schedules
    items = load.items(SCHEDULE.count, SCHEDULE, 5)
    assert [it.arrival for it in items] == workload.piecewise_arrivals(
        SCHEDULE, 1.0, np.random.default_rng(5))
    plain = workload.make_workload(workload.MIXED, SCHEDULE.count, 3.0, 1.0, 5)
    assert [(it.cls, it.input_len) for it in items] == [(it.cls, it.input_len) for it in plain]
    assert load.items(10, 2.0, 5) == workload.make_workload(workload.MIXED, 10, 2.0, 1.0, 5)


def test_a_schedule_is_refused_where_it_does_not_fit(tmp_path: Path) -> None:
    args = make_parser().parse_args(["--rates", "1:10,2:10", "--num-prompts", "5"])
    with pytest.raises(ValueError, match="--num-prompts"):
        paces_of(args.rates, args, _trace_load(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    chat = _trace_load(tmp_path, "--workload", "multiturn")
    args = make_parser().parse_args(["--rates", "1:10,2:10"])
    with pytest.raises(ValueError, match="timed trace"):
        paces_of(args.rates, args, chat)
    assert paces_of(args.rates, args, _trace_load(tmp_path)) == [args.rates]
    listed = make_parser().parse_args(["--rates", "1,2"])
    assert paces_of(listed.rates, listed, chat) == [1.0, 2.0]


def test_bench_refuses_a_bad_schedule_or_profile_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    common = ["--model", str(tmp_path), "--out", str(out)]
    assert bench_main(["--rates", "1:10", "--num-prompts", "4", *common]) == 2
    assert bench_main(["--configs", "2auto", "--profile", str(tmp_path / "no.json"),
                       *common]) == 2
    assert "--profile" in capsys.readouterr().err
    assert not out.exists()


# ---- per-segment summaries -----------------------------------------------------------------


def _record(start: float, ttft: float = 0.1, tpot: float = 0.01) -> Record:
    return Record(100, 11, ttft=ttft, e2e=ttft + 10 * tpot, itl=[tpot] * 10, start=start)


def test_the_runs_zero_is_the_least_lag_behind_the_trace() -> None:
    arrivals = [0.5, 1.0, 2.0]
    starts = [1000.51, 1001.02, 1002.005]  # sent a little after each was due
    assert clock_zero(starts, arrivals) == pytest.approx(1000.005)
    assert clock_zero(starts, []) is None  # the conversation runner gives no arrivals
    assert clock_zero([], []) is None


def test_records_split_by_when_they_were_sent() -> None:
    zero, starts = 500.0, [0.0, 10.0, 20.0]
    recs = [_record(zero + t) for t in (0.2, 9.99, 10.0, 15.0, 29.0, 31.0)]
    parts = split_by_start(recs, zero, starts)
    assert [len(p) for p in parts] == [2, 2, 2]  # the last segment takes the late ones


def test_segments_have_their_own_goodput_latencies_and_slo() -> None:
    schedule = Schedule((Segment(1.0, 10.0), Segment(2.0, 10.0)))
    zero = 100.0
    calm = [_record(zero + 0.5 + i) for i in range(10)]  # all meet the SLO
    # The burst: half miss TPOT (30 ms > 18 ms).
    busy = [_record(zero + 10.2 + i / 2, tpot=0.03 if i % 2 else 0.01) for i in range(20)]
    segs = summarize_segments(calm + busy, zero, schedule, Slo())
    assert [(s["rate"], s["start_s"], s["seconds"]) for s in segs] == [(1.0, 0.0, 10.0),
                                                                       (2.0, 10.0, 10.0)]
    first, second = segs[0]["summary"], segs[1]["summary"]
    assert (first["requests"], first["goodput"], first["slo_attainment"]) == (10, 1.0, 1.0)
    assert (second["requests"], second["goodput"], second["slo_attainment"]) == (20, 1.0, 0.5)
    assert first["tpot"]["p99"] == pytest.approx(10.0)
    assert second["tpot"]["p99"] == pytest.approx(30.0)
    assert second["ttft"]["p50"] == pytest.approx(100.0)


# ---- duties --------------------------------------------------------------------------------


def _samples(*points: tuple[float, dict[str, str]]) -> list[Sample]:
    return [Sample(t, d) for t, d in points]


def test_changes_and_time_to_adapt_from_the_duty_timeline() -> None:
    line = _samples(
        (-2.0, {"auto-0": "prefill", "auto-1": "decode"}),
        (-1.0, {"auto-0": "prefill", "auto-1": "both"}),  # before the run's t = 0
        (65.0, {"auto-0": "both", "auto-1": "both"}),
        (66.0, {"auto-1": "both"}),  # auto-0 missing from one read: not a change
        (71.5, {"auto-0": "decode", "auto-1": "both"}),
        (130.0, {"auto-0": "prefill", "auto-1": "decode", "auto-2": "both"}),  # a newcomer
    )
    found = duties.changes(line)
    assert found == [Change(-1.0, "auto-1", "decode", "both"),
                     Change(65.0, "auto-0", "prefill", "both"),
                     Change(71.5, "auto-0", "both", "decode"),
                     Change(130.0, "auto-0", "decode", "prefill"),
                     Change(130.0, "auto-1", "both", "decode")]
    assert duties.time_to_adapt(found, [0.0, 60.0, 120.0]) == [None, 11.5, 10.0]
    assert duties.time_to_adapt([], [0.0, 60.0]) == [None, None]
    # The last segment runs on until the run ends.
    assert duties.time_to_adapt([Change(200.0, "w", "a", "b")], [0.0, 60.0]) == [None, 140.0]


def test_the_summary_counts_from_the_runs_zero() -> None:
    raw = _samples((1000.0, {"w": "prefill"}), (1065.25, {"w": "both"}))
    s = duties.summary(raw, 1001.0, [0.0, 60.0])
    assert s["timeline"] == [{"t": -1.0, "duties": {"w": "prefill"}},
                             {"t": 64.25, "duties": {"w": "both"}}]
    assert s["changes"] == [{"t": 64.25, "worker": "w", "old": "prefill", "new": "both"}]
    assert s["time_to_adapt_s"] == [None, 4.25]
    assert "time_to_adapt_s" not in duties.summary(raw, 1001.0)  # a plain-rate run


def test_duties_by_the_benchs_names_fixed_roles_as_their_duty() -> None:
    pool = [{"id": "auto-1a2b", "role": "auto", "duty": "decode", "pid": 41},
            {"id": "prefill-9f", "role": "prefill", "pid": 42},
            {"id": "auto-3c4d", "role": "auto", "duty": "both", "pid": 99}]
    assert duties.duties_of(pool, {41: "auto-0", 42: "prefill-1"}) == {
        "auto-0": "decode", "prefill-1": "prefill", "auto-3c4d": "both"}


def test_the_poller_keeps_changes_and_ignores_failed_reads() -> None:
    reads: list[Any] = [
        [{"id": "a", "role": "auto", "duty": "prefill"}],
        OSError("timed out"),
        [{"id": "a", "role": "auto", "duty": "prefill"}],
        ValueError("not JSON"),
        [{"id": "a", "role": "auto", "duty": "both"}],
    ]
    now = iter(range(100))

    def fetch() -> list[dict[str, Any]]:
        r = reads.pop(0)
        if isinstance(r, Exception):
            raise r
        return list(r)

    poller = DutyPoller(fetch, clock=lambda: float(next(now)))
    for _ in range(5):
        poller.poll()
    assert [(s.t, s.duties) for s in poller.samples] == [(0.0, {"a": "prefill"}),
                                                         (1.0, {"a": "both"})]


def test_the_poller_reads_in_its_thread_until_stopped() -> None:
    read = threading.Event()

    def fetch() -> list[dict[str, Any]]:
        read.set()
        return [{"id": "a", "role": "auto", "duty": "decode"}]

    with DutyPoller(fetch, interval=0.01) as poller:
        assert read.wait(5.0)
    assert poller.stop() == poller.samples and len(poller.samples) == 1
    assert not poller._thread.is_alive()


def test_the_runs_zero_falls_back_to_the_clients_launch() -> None:
    import time

    now = time.monotonic()
    assert run_zero(now - 0.5, now - 2.0) == (now - 0.5, "trace start")
    assert run_zero(None, now - 2.0) == (now - 2.0, "client launch")
    assert run_zero(now - 100.0, now - 2.0) == (now - 2.0, "client launch")  # another clock


# ---- report --------------------------------------------------------------------------------


def _schedule_results(tmp_path: Path) -> tuple[dict, dict]:
    schedule = Schedule((Segment(1.0, 10.0), Segment(2.0, 10.0)))
    zero = 100.0
    recs = ([_record(zero + 0.5 + i) for i in range(10)]
            + [_record(zero + 10.2 + i / 2, tpot=0.03 if i % 2 else 0.01) for i in range(20)])
    raw = {"ttfts": [r.ttft for r in recs], "itls": [r.itl for r in recs],
           "latencies": [r.e2e for r in recs], "input_lens": [r.input_len for r in recs],
           "output_lens": [r.output_len for r in recs], "start_times": [r.start for r in recs],
           "errors": [""] * len(recs)}
    (tmp_path / "raw").mkdir(parents=True, exist_ok=True)
    tag = workload.run_tag(schedule)
    (tmp_path / "raw" / f"2auto-{tag}.json").write_text(json.dumps(raw))
    line = _samples((-3.0, {"auto-0": "prefill", "auto-1": "decode"}),
                    (13.5, {"auto-0": "both", "auto-1": "decode"}))
    run = {"rate": schedule.mean_rate, "duration": 21.0, "raw": f"raw/2auto-{tag}.json",
           "schedule": schedule.label(), "clock_zero": zero,
           "summary": summarize(recs, 21.0, Slo()),
           "segments": summarize_segments(recs, zero, schedule, Slo()),
           "controller": {"pdserve_role_changes_total{why=slo}": 1.0},
           "duties": duties.summary(line, 0.0, schedule.starts()) | {"since": "trace start"}}
    plain = {"rate": 1.5, "duration": 21.0, "summary": summarize(recs, 21.0, Slo()),
             "duties": duties.summary(line[:1], 0.0) | {"since": "client launch"}}
    results = {"meta": {"slo": "ttft:2000 tpot:18", "schedule": schedule.label()},
               "configs": {"2auto": {"runs": [run]}, "2auto-plain": {"runs": [plain]}}}
    return results, {("2auto", run["rate"]): recs}


def test_the_report_shows_segments_changes_and_time_to_adapt(tmp_path: Path) -> None:
    results, records = _schedule_results(tmp_path)
    report.write_report(results, records, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## By segment of the schedule 1:10,2:10" in md
    assert "| 2auto | 0-10 | 1 | 10 | 100 / 100 | 10.0 / 10.0 | 1.00 | 100% |" in md
    assert "| 2auto | 10-20 | 2 | 20 | 100 / 100 | 20.0 / 30.0 | 1.00 | 50% |" in md
    assert "| 2auto | whole run | 1.50 (mean) | 30 |" in md
    assert "| 2auto | 1:10,2:10 | 30 / 0 |" in md  # the schedule where a rate would be
    assert "### 2auto at 1:10,2:10 (seconds since the trace start)" in md
    assert "- at -3.0 s: auto-0 prefill, auto-1 decode" in md
    assert "- 13.5 s: auto-0 prefill -> both" in md
    assert ("- time to adapt (segment start -> its last duty change): 1 req/s from 0 s: "
            "no change; 2 req/s from 10 s: 3.5 s") in md
    assert "{why=slo} +1" in md
    assert "### 2auto-plain at 1.5 (seconds since the client launch)" in md
    assert "- no duty changed" in md


def test_rerendering_recomputes_each_segment(tmp_path: Path) -> None:
    from pdserve.bench.main import rerender

    results, _ = _schedule_results(tmp_path)
    del results["configs"]["2auto-plain"]
    stale = results["configs"]["2auto"]["runs"][0]
    stale["segments"] = []
    (tmp_path / "results.json").write_text(json.dumps(report.no_nan(results)))
    again = rerender(tmp_path)["configs"]["2auto"]["runs"][0]
    assert [s["summary"]["requests"] for s in again["segments"]] == [10, 20]
    assert again["duties"]["time_to_adapt_s"] == [None, 3.5]


def test_a_run_without_any_reading_of_the_pool_says_so() -> None:
    run = {"rate": 2.0, "duties": duties.summary([], 0.0) | {"since": "trace start"}}
    assert duties.markdown("2auto at 2", run)[-1] == (
        "- no reading of /pd/workers succeeded during the run")
