"""`pdserve plan`'s parts: the simulator against closed-form cases, the fit against a results
folder written in the bench's schema, and the command end to end (no engine, no bench run)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pdserve import cli
from pdserve.bench import metrics, report
from pdserve.bench.workload import RequestClass
from pdserve.planner import fit
from pdserve.planner.capacity import Slo, queue_wait
from pdserve.planner.costmodel import Profile
from pdserve.planner.sim import PoolSpec, simulate

LOOSE = Slo(ttft_ms=1e9, tpot_ms=1e9)
LINEAR = Profile(prefill_base_s=0.01, prefill_per_token_s=1e-4, step_base_s=0.005,
                 step_per_running_s=0.001, step_per_kkv_s=0.0, handoff_s=0.04)


def one(prompt: int, out: int) -> tuple[RequestClass, ...]:
    return (RequestClass("x", 1.0, prompt, prompt, out),)


# -- the simulator against closed forms ---------------------------------------------------------

@pytest.mark.parametrize("rho, tolerance", [(0.5, 0.05), (0.8, 0.10)])
def test_prefill_queue_is_md1(rho, tolerance):
    # One prompt per prefill batch (chunk = prompt), all alike, Poisson arrivals: an M/D/1
    # queue, mean wait rho*S / (2(1-rho)). Tolerance: the sampling error of 20,000 requests.
    p = dataclasses.replace(LINEAR, chunk_tokens=1000)
    s = p.prefill_seconds(1000)
    r = simulate(PoolSpec(1, 1), p, one(1000, 2), rho / s, LOOSE, num_requests=20_000)
    wait = r.ttft_ms["mean"] / 1e3 - s
    assert wait == pytest.approx(rho * s / (2 * (1 - rho)), rel=tolerance)
    assert wait == pytest.approx(queue_wait(rho / s, s, s * s), rel=tolerance)


def test_light_load_tpot_is_the_step_time_of_one_stream():
    # Arrivals 5 s apart (no gamma noise), 20 tokens each: every stream decodes alone.
    held = simulate(PoolSpec(1, 1, first_token="decode"), LINEAR, one(500, 20), 0.2, LOOSE,
                    num_requests=10, burstiness=math.inf)
    streamed = simulate(PoolSpec(1, 1), LINEAR, one(500, 20), 0.2, LOOSE, num_requests=10,
                        burstiness=math.inf)
    step = LINEAR.step_seconds(1, 0)
    assert held.tpot_ms["p50"] == pytest.approx(held.tpot_ms["p99"])
    assert held.tpot_ms["mean"] == pytest.approx(1e3 * step)
    # First token from the prefill: the handoff is the first gap, 19 gaps in all.
    assert streamed.tpot_ms["mean"] == pytest.approx(1e3 * (step + LINEAR.handoff_s / 19))
    assert streamed.ttft_ms["mean"] == pytest.approx(1e3 * LINEAR.prefill_seconds(500))


def test_a_batch_of_streams_decodes_at_the_step_time_of_that_batch():
    # Eight requests at once: one prefill batch, eight streams joining together.
    r = simulate(PoolSpec(1, 1, first_token="decode"), LINEAR, one(200, 50), math.inf, LOOSE,
                 num_requests=8)
    assert r.completed == 8
    assert r.tpot_ms["p50"] == pytest.approx(1e3 * LINEAR.step_seconds(8, 0))
    assert r.tpot_ms["p99"] == pytest.approx(r.tpot_ms["p50"])


def test_a_colocated_prefill_stalls_the_stream_for_its_chunk():
    # One `both` worker: request 0 is decoding when request 1 arrives; at the next step
    # boundary a step carries request 1's whole prefill (and a token for request 0), then both
    # decode together.
    n, out, rate = 1000, 200, 1.9
    r = simulate(PoolSpec(both=1), LINEAR, one(n, out), rate, LOOSE, num_requests=2,
                 burstiness=math.inf)
    first0 = 1 / rate + LINEAR.prefill_seconds(n)
    step1, step2 = LINEAR.step_seconds(1, 0), LINEAR.step_seconds(2, 0)
    alone = math.ceil((2 / rate - first0) / step1)  # steps before request 1's chunk
    chunk = max(LINEAR.prefill_base_s, LINEAR.step_base_s) + LINEAR.step_per_running_s \
        + LINEAR.prefill_per_token_s * n
    # Request 0: `alone` steps, the chunk's step, then steps with request 1 until its end.
    with_other = out - 2 - alone
    tpot0 = (alone * step1 + chunk + with_other * step2) / (out - 1)
    # Request 1: as many steps with request 0, then the rest alone.
    tpot1 = (with_other * step2 + (out - 1 - with_other) * step1) / (out - 1)
    assert r.tpot_ms["mean"] == pytest.approx(1e3 * (tpot0 + tpot1) / 2, rel=1e-9)
    assert r.tpot_ms["p99"] == pytest.approx(1e3 * np.percentile([tpot0, tpot1], 99), rel=1e-9)
    assert tpot0 > tpot1  # the stall is request 0's


def test_512_workers_for_a_minute_of_traffic_take_seconds():
    classes = (RequestClass("long", 0.3, 1500, 2000, 32),
               RequestClass("short", 0.7, 90, 110, 128))
    r = simulate(PoolSpec(128, 384), Profile(), classes, 512.0, Slo(2000, 18), duration=60.0)
    assert r.requests == 30_720 and r.completed == r.requests
    assert 0 < r.wall_s < 10.0
    assert r.slo_attainment > 0.9  # a light load for this pool


# -- a results folder in the bench's schema ------------------------------------------------------

TRUE = Profile(prefill_base_s=0.03, prefill_per_token_s=1.1e-4, step_base_s=0.007,
               step_per_running_s=0.0009, step_per_kkv_s=0.0004, handoff_s=0.04)
MIX = "0.5:100-2000:24"


def _request(start: float, prompt: int, out: int, batch: int) -> dict:
    step = TRUE.step_seconds(batch, batch * (prompt + out / 2))
    itl = [TRUE.handoff_s + step] + [step] * (out - 2)
    ttft = TRUE.prefill_seconds(prompt)
    return {"start": start, "input": prompt, "output": out, "ttft": ttft, "itl": itl,
            "latency": ttft + sum(itl)}


def _raw(reqs: list[dict]) -> dict:
    return {"duration": max(r["start"] + r["latency"] for r in reqs),
            "input_lens": [r["input"] for r in reqs], "output_lens": [r["output"] for r in reqs],
            "ttfts": [r["ttft"] for r in reqs], "itls": [r["itl"] for r in reqs],
            "latencies": [r["latency"] for r in reqs],
            "start_times": [r["start"] for r in reqs], "errors": [""] * len(reqs)}


def write_results(out: Path, *, noisy_extra: bool = False) -> Path:
    """A folder as `pdserve bench --configs 1P1D@0,colocated --mix ...` writes it: requests
    alone at a low rate (the prefill fit's), and in batches of known size (the decode fit's)."""
    rng = np.random.default_rng(0)
    alone = [_request(3.0 * i, int(rng.integers(100, 2000)), 24, 1) for i in range(40)]
    batches = [_request(10.0 * g, 600, 32, size) for g, size in enumerate(range(1, 9))
               for _ in range(size)]
    runs = {("1P1D@0", 0.33): alone, ("1P1D@0", 4.0): batches,
            ("colocated", 4.0): batches}
    if noisy_extra:  # garbage timings, but others' jobs took 80% of a core meanwhile
        runs[("1P1D@0", 0.2)] = [dict(r, ttft=r["ttft"] * 5) for r in alone]
    (out / "raw").mkdir(parents=True)
    configs: dict = {}
    for (name, rate), reqs in runs.items():
        raw = _raw(reqs)
        path = f"raw/{name}-r{rate:g}.json"
        (out / path).write_text(json.dumps(raw))
        recs = metrics.records_from_vllm(raw)
        roles = ["prefill", "decode"] if name.startswith("1P1D") else ["both", "both"]
        noise = 80.0 if rate == 0.2 else 1.0
        cpu = {f"{role}-{i}": {"cpu_s": 1.0, "core_pct": 30.0 + 10 * i}
               for i, role in enumerate(roles)}
        cpu |= {"others": {"cpu_s": 0.5, "core_pct": noise}, "controller": {"core_pct": 5.0}}
        entry = configs.setdefault(name, {"roles": roles, "cores": {}, "runs": [],
                                          "idle_cpu": {f"{r}-{i}": {"core_pct": 3.0}
                                                       for i, r in enumerate(roles)}})
        entry["runs"].append({
            "rate": rate, "num_prompts": len(reqs), "duration": raw["duration"],
            "summary": metrics.summarize(recs, raw["duration"], metrics.Slo(2000, 18)),
            "cpu": cpu, "controller": {"kv_handoff_mean_ms": 1e3 * TRUE.handoff_s},
            "raw": path})
    meta = {"command": f"pdserve bench --configs 1P1D@0,colocated --rates 0.33,4 --mix {MIX}",
            "slo": "ttft:2000 tpot:18"}
    (out / "results.json").write_text(json.dumps(report.no_nan({"meta": meta,
                                                                 "configs": configs})))
    return out


def test_fit_recovers_the_profile_from_a_results_folder(tmp_path):
    got = fit.fit_profile(write_results(tmp_path))
    p = got.profile
    assert p.prefill_base_s == pytest.approx(TRUE.prefill_base_s, rel=0.02)
    assert p.prefill_per_token_s == pytest.approx(TRUE.prefill_per_token_s, rel=0.02)
    assert p.step_base_s == pytest.approx(TRUE.step_base_s, rel=0.05)
    assert p.step_per_running_s == pytest.approx(TRUE.step_per_running_s, rel=0.05)
    assert p.step_per_kkv_s == pytest.approx(TRUE.step_per_kkv_s, rel=0.05)
    assert p.handoff_s == pytest.approx(TRUE.handoff_s, rel=0.02)
    assert any("chunk_tokens" in n for n in got.notes)  # what the folder cannot tell
    assert any(c.startswith("1P1D@0 at 4 req/s: prefill CPU 27%") for c in got.checks)


def test_fit_leaves_out_noisy_runs(tmp_path):
    got = fit.fit_profile(write_results(tmp_path, noisy_extra=True))
    assert got.profile.prefill_base_s == pytest.approx(TRUE.prefill_base_s, rel=0.02)
    assert any("1 noisy runs" in n for n in got.notes)


def test_fit_reads_the_workload_from_the_bench_command(tmp_path):
    meta, runs = fit.read_results(write_results(tmp_path))
    assert [(r.config, r.rate, r.disaggregated) for r in runs] == [
        ("1P1D@0", 0.33, True), ("1P1D@0", 4.0, True), ("colocated", 4.0, False)]
    assert runs[0].threshold == 0
    classes = fit.workload_of(meta)
    assert classes is not None and (classes[0].input_min, classes[0].output_len) == (100, 24)
    assert fit.workload_of({"command": "pdserve bench --workload multiturn"}) is None
    random = fit.workload_of({"command": "pdserve bench --workload random --input-len 300"})
    assert random is not None and random[0].input_min == 300


def test_fit_needs_a_disaggregated_configuration(tmp_path):
    folder = write_results(tmp_path)
    results = json.loads((folder / "results.json").read_text())
    del results["configs"]["1P1D@0"]
    (folder / "results.json").write_text(json.dumps(results))
    with pytest.raises(ValueError, match="disaggregated"):
        fit.fit_profile(folder)


def test_plan_prints_candidates_a_recommendation_and_the_validation(tmp_path, capsys):
    folder = write_results(tmp_path / "bench")
    saved = tmp_path / "profile.json"
    assert cli.main(["plan", "--results", str(folder), "--rate", "3", "--duration", "20",
                     "--validate", "--workers", "2,16", "--save-profile", str(saved)]) == 0
    text = capsys.readouterr().out
    assert "2 workers at 3 req/s" in text and "16 workers at 24 req/s" in text
    assert "| 1P1D@0 |" in text and "| colocated2 |" in text and "| 1P1D@128 |" in text
    assert text.count("recommended: ") == 2
    assert "| 1P1D@0 | 4 |" in text and "| colocated | 4 |" in text  # validation rows
    assert "mean absolute error" in text
    assert "role planner for 16 auto workers" in text
    assert Profile.from_json(saved.read_text()).handoff_s == pytest.approx(0.04, rel=0.02)


def test_plan_validates_on_held_out_rates_only(tmp_path, capsys):
    folder = write_results(tmp_path / "bench")
    assert cli.main(["plan", "--results", str(folder), "--validate", "--hold-out", "4",
                     "--duration", "20"]) == 0
    text = capsys.readouterr().out
    assert "held out (not fit): the runs at 4 req/s" in text
    assert "| 1P1D@0 | 4 |" in text and "| colocated | 4 |" in text
    assert "| 1P1D@0 | 0.33 |" not in text  # the run the profile was fit on
    assert "over 2 runs" in text
    assert cli.main(["plan", "--results", str(folder), "--hold-out", "4,0.33"]) == 2
    assert "no runs" in capsys.readouterr().err


def test_plan_recommends_colocated_when_the_decode_worker_saturates(tmp_path, capsys):
    # Decode steps that grow fast with the batch: one decode worker cannot keep up at 6 req/s,
    # two `both` workers can; at 1 req/s 1P1D has room.
    p = Profile(prefill_base_s=0.01, prefill_per_token_s=1e-4, step_base_s=0.004,
                step_per_running_s=0.0016, handoff_s=0.05)
    path = tmp_path / "p.json"
    path.write_text(p.to_json())
    for rate, want in ((6, "recommended: colocated2"), (1, "recommended: 1P1D@0")):
        assert cli.main(["plan", "--profile", str(path), "--rate", str(rate), "--mix",
                         "0.3:1500-2000:32,0.7:90-110:128", "--duration", "60"]) == 0
        assert want in capsys.readouterr().out
