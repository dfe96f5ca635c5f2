"""`--role auto` with real engines: the controller's role planner turns two colocated auto workers
into 1P1D while a long stream runs on one of them; the stream finishes whole and equal to one
plain engine, later requests follow the new duties, and no KV block is left in use.

The same workers also serve a second controller that places each request by the SLO
(`--placement slo`): its answers equal one engine's and each says which SLO rule placed it."""

from __future__ import annotations

import re
import threading
import time

import pytest
from procs import Proc, free_port, get_json, pdserve, ready_workers, wait_for
from test_openai import complete, prompt_ids

LONG = 3000  # output tokens: the stream must outlast two planner holds (1.5 s each)


@pytest.fixture(scope="module")
def auto_pool(model_dir, logs, keys):
    port, wport, port2, wport2 = free_port(), free_port(), free_port(), free_port()
    ctl = Proc("controller-auto", pdserve(
        "controller", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
        "--worker-port", str(wport), "--keys", keys, "--heartbeat-interval", "0.5",
        "--plan-interval", "0.25", "--plan-hold", "1.5", "--plan-cooldown", "0",
        # An SLO every split meets by far: the planner's rule alone (fewest `both` workers)
        # decides, whatever its cost model makes of a machine this test shares with others.
        "--slo", "ttft:100000", "tpot:100000"), logs)
    placing = Proc("controller-slo", pdserve(
        "controller", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port2),
        "--worker-port", str(wport2), "--keys", keys, "--heartbeat-interval", "0.5",
        "--placement", "slo", "--slo", "ttft:2000", "tpot:50"), logs)
    workers = [Proc(f"auto-{i}", pdserve(
        "worker", "--role", "auto", "--worker-id", f"auto-{i}",
        "--controller", f"tcp://127.0.0.1:{wport}", "--controller", f"tcp://127.0.0.1:{wport2}",
        "--keys", keys, "--model", model_dir, "--advertise-host",
        "127.0.0.1", "--heartbeat-interval", "0.5", "--cores", str(i)), logs) for i in (0, 1)]
    base, base2 = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port2}"
    try:
        for b in (base, base2):
            wait_for(lambda: len(ready_workers(b)) == 2, 400, "two auto workers",
                     [ctl, placing, *workers])
        yield base, ctl, base2, placing
    finally:
        for w in workers:
            w.stop()
        ctl.stop()
        placing.stop()


def long_completion(client, model: str, prompt: list[int]) -> list[int]:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=LONG, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    return r.choices[0].token_ids


def duties(base: str) -> dict[str, str]:
    return {w["id"]: w["duty"] for w in get_json(base + "/pd/workers")}


def test_a_stream_finishes_whole_across_its_workers_duty_change(auto_pool, ref_client,
                                                                 model_dir):
    import openai

    base, ctl, _, _ = auto_pool
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=300, max_retries=0)
    seen: list[dict[str, str]] = []  # the duties, polled while the stream runs
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            seen.append(duties(base))
            time.sleep(0.1)

    prompt = prompt_ids(200, 9700)
    assert set(duties(base).values()) == {"both"}  # as they start: each serves requests whole
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        ours = long_completion(client, model_dir, prompt)
    finally:
        done.set()
        poller.join()
    assert ours == long_completion(ref_client, model_dir, prompt)
    assert len(ours) == LONG
    [host] = re.findall(r"request \S+: local \(auto\) decode=(\S+)", ctl.log())
    # The worker that carried the stream had its duty changed while it ran.
    assert seen[0][host] == "both" and seen[-1][host] != "both", seen[:: max(1, len(seen) // 8)]
    wait_for(lambda: sorted(duties(base).values()) == ["decode", "prefill"], 30, "1P1D")
    # Later requests follow the new duties, and equal one engine still.
    prompt = prompt_ids(300, 9701)
    ours, _ = complete(client, model_dir, prompt, max_tokens=16, temperature=0)
    assert ours == complete(ref_client, model_dir, prompt, max_tokens=16, temperature=0)[0]
    assert re.findall(r"request \S+: (local|disaggregated)", ctl.log())[-1] == "disaggregated"
    # Nothing left in use on either engine once their next heartbeats report.
    wait_for(lambda: all(w["kv_usage"] == 0 and w["running"] == 0
                         for w in get_json(base + "/pd/workers")), 20, "engines idle")
    # Both changes were counted (the planner may have moved on since: the count is >= 2).
    counted = re.findall(r'^pdserve_role_changes_total\{why="(\w+)"\} ([0-9.]+)$', _metrics(base),
                         re.M)
    assert sum(float(n) for _, n in counted) >= 2, counted


def test_placement_by_the_slo_answers_as_one_engine_and_says_why(auto_pool, ref_client,
                                                                   model_dir):
    import openai

    _, _, base, ctl = auto_pool
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=300, max_retries=0)
    for k, n in enumerate((100, 1500, 300)):
        prompt = prompt_ids(n, 9800 + k)
        ours, _ = complete(client, model_dir, prompt, max_tokens=24, temperature=0)
        assert ours == complete(ref_client, model_dir, prompt, max_tokens=24, temperature=0)[0]
    routes = re.findall(r"request \S+: (local|disaggregated) \((\w+)\)", ctl.log())
    assert len(routes) == 3 and {why for _, why in routes} <= {
        "slo_local", "slo_disagg", "least_violation"}, routes
    counted = re.findall(r'^pdserve_routes_total\{path="(\w+)",reason="(\w+)"\} ([0-9.]+)$',
                         _metrics(base), re.M)
    assert sum(float(n) for _, why, n in counted if why.startswith(("slo_", "least"))) == 3
    wait_for(lambda: all(w["kv_usage"] == 0 and w["running"] == 0 and
                         w["queued_prefill_tokens"] == 0 for w in get_json(base + "/pd/workers")),
             20, "engines idle")


def _metrics(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        return r.read().decode()
