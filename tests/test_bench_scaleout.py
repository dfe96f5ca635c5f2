"""`pdserve bench scaleout`: its arguments, per-process CPU, the ratios and the report (no
controller is started here: a run takes minutes and saturates the cores)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench import scaleout


def row(n: int, tok_s: float, us_per_token: float, each: list[float]) -> dict:
    return {"api_servers": n, "output_tok_s": tok_s, "controller_core_pct": sum(each) + 1,
            "api_server_core_pct": each, "controller_us_per_token": us_per_token,
            "workers_core_pct": 30.0, "client_core_pct": 45.0, "others_core_pct": 2.0,
            "machine_core_pct": 190.0, "ttft_p50_ms": 95.0, "itl_p99_ms": None, "failed": 0}


def test_the_api_server_counts_are_distinct_and_positive() -> None:
    assert scaleout.levels("1,2") == [1, 2]
    assert scaleout.levels(" 2 , 4,1") == [2, 4, 1]
    for bad in ("0,1", "1,1", "one", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            scaleout.levels(bad)
    args = scaleout.make_parser().parse_args([])
    assert (args.api_servers, args.concurrency, args.requests) == ([1, 2], 64, None)
    assert scaleout.make_parser().parse_args(["--api-servers", "1,3"]).api_servers == [1, 3]


def test_process_cpu_reads_each_live_process(tmp_path) -> None:
    ticks = scaleout.procs.TICKS
    for pid, (utime, stime) in {7: (3 * ticks, ticks), 8: (ticks, 0)}.items():
        (tmp_path / str(pid)).mkdir()
        # comm may hold spaces and parentheses; utime and stime are fields 14 and 15
        (tmp_path / str(pid) / "stat").write_text(
            f"{pid} (python -m (x)) S 1 {pid} {pid} 0 -1 0 0 0 0 0 {utime} {stime} 0 0\n")
    assert scaleout.process_cpu([7, 8, 9], tmp_path) == {7: 4.0, 8: 1.0}  # 9 has gone


def test_ratios_against_the_first_count_and_the_target() -> None:
    rows = [row(1, 8000.0, 125.0, [99.0]), row(2, 10000.0, 140.0, [75.0, 70.0])]
    [r] = scaleout.ratios(rows)
    assert r == {"api_servers": 2, "baseline": 1, "tokens_per_s": 1.25,
                 "controller_cpu_per_token": 1.12}
    assert scaleout.verdict(r) == ("2 API servers stream 1.25x the tokens/s of 1, at 1.12x the "
                                   "controller CPU per token (target >= 1.7x: not met)")
    met = scaleout.ratios([rows[0], row(2, 14000.0, 120.0, [99.0, 99.0])])[0]
    assert scaleout.verdict(met).endswith("(target >= 1.7x: met)")
    other = scaleout.ratios([row(2, 1.0, 1.0, []), row(4, 2.0, 1.0, [])])[0]
    assert "target" not in scaleout.verdict(other)  # the target is for 2 against 1
    assert scaleout.ratios([]) == [] and scaleout.ratios(rows[:1]) == []


def test_the_report_shows_where_the_cores_went() -> None:
    rows = [row(1, 8000.0, 125.0, [99.0]), row(2, 10000.0, 140.0, [75.0, 70.0])]
    res = {"command": "pdserve bench scaleout", "model": "/m", "cores": 2,
           "machine": {"cpus": [0, 1], "loadavg": ["0.5", "0.4", "0.3"], "cpu_model": "X"},
           "workload": "192 requests", "rows": rows, "ratios": scaleout.ratios(rows)}
    md = scaleout.markdown(res).splitlines()
    header = next(line for line in md if line.startswith("| API servers"))
    assert len(header.split("|")) == len(md[md.index(header) + 1].split("|"))
    assert md[md.index(header) + 2] == ("| 1 | 8,000 | 100 | 99 | 125 | 30 | 45 | 2 | 190 | 95.0 "
                                        "| - | 0 |")
    assert md[md.index(header) + 3].startswith("| 2 | 10,000 | 146 | 75 / 70 | 140 |")
    assert "this machine has 2 core(s) (200 % in all)" in "\n".join(md)
    assert md[-1] == "- " + scaleout.verdict(res["ratios"][0])
    assert "cores 0,1, load average at the start 0.5 0.4 0.3" in md[3]
