"""Cache-aware P/D with real engines (the shared 1P1D `pd_server`, default routing): the engines'
KV events reach the controller's index, a conversation's later turns read only the KV blocks the
decode engine lacks, a short remainder is prefilled by the decode worker itself (no handoff),
every turn's output equals one plain engine's, and a controller that joins late learns what
an engine holds from the replay of its events."""

from __future__ import annotations

import json
import re
import signal
import urllib.request

from procs import get_json, metric
from test_openai import prompt_ids

REPLY = 16


def complete(base: str, model: str, prompt: list[int]) -> tuple[list[int], str]:
    """Greedy token ids of a completion, and its route receipt."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": REPLY, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
        return out["choices"][0]["token_ids"], r.headers.get("x-pdserve-route") or ""


def cached(receipt: str, side: str) -> int:
    m = re.search(rf"{side}=\S+ cached=(\d+)", receipt)
    assert m, receipt
    return int(m[1])


def test_a_conversation_reads_only_the_kv_the_decode_engine_lacks(pd_server, reference,
                                                                  model_dir):
    base, ref = pd_server.base, reference.base
    B = get_json(base + "/pd/workers")[0]["block_size"]
    moved = "pdserve_kv_transfer_bytes_sum"
    skipped = 'pdserve_routes_total{path="local",reason="cached"}'
    # Turn 1: nothing cached anywhere, the whole prompt is handed over.
    prompt = prompt_ids(5 * B + 30, seed=7101)
    before = metric(base, moved)
    reply, receipt = complete(base, model_dir, prompt)
    assert reply == complete(ref, model_dir, prompt)[0]
    assert receipt.startswith("disaggregated") and cached(receipt, "decode") == 0
    first = metric(base, moved) - before
    assert first > 0
    # Turn 2: the decode engine kept turn 1 (5 full blocks): only the 3 new blocks move.
    prompt = prompt + reply
    prompt += prompt_ids(8 * B - 15 - len(prompt), seed=7102)
    before = metric(base, moved)
    reply, receipt = complete(base, model_dir, prompt)
    assert reply == complete(ref, model_dir, prompt)[0]
    assert receipt.startswith("disaggregated"), receipt
    assert cached(receipt, "prefill") == 5 * B and cached(receipt, "decode") == 5 * B
    assert metric(base, moved) - before == first // 2
    # Turn 3: the decode engine holds all but 21 tokens (it computed turn 2's reply too):
    # it prefills them itself, nothing moves.
    prompt = prompt + reply + prompt_ids(20, seed=7103)
    before, was_skipped = metric(base, moved), metric(base, skipped)
    reply, receipt = complete(base, model_dir, prompt)
    assert reply == complete(ref, model_dir, prompt)[0]
    assert receipt.startswith("local (cached)") and cached(receipt, "decode") == 8 * B, receipt
    assert metric(base, moved) == before
    assert metric(base, skipped) == was_skipped + 1


def test_the_handoff_is_measured_phase_by_phase(pd_server, model_dir):
    base = pd_server.base
    count = 'pdserve_handoff_phase_seconds_count{phase="%s"}'
    before = {p: metric(base, count % p) for p in ("transit", "kv_read", "first_step")}
    complete(base, model_dir, prompt_ids(300, seed=7201))
    for phase, n in before.items():  # the decode worker reported its engine's times
        assert metric(base, count % phase) == n + 1, phase


def index_of(base: str, worker_id: str) -> dict | None:
    return next((w for w in get_json(base + "/pd/workers") if w["id"] == worker_id), None)


def test_a_restarted_decode_worker_starts_with_nothing_in_the_index(pd_server, reference,
                                                                    model_dir, logs):
    from procs import wait_for
    from test_pool import start_worker

    base, ref, name = pd_server.base, reference.base, "decode-0-reborn"  # sorts first: ties go to it
    B = get_json(base + "/pd/workers")[0]["block_size"]
    extra = start_worker(name, "decode", pd_server, model_dir, logs)
    try:
        wait_for(lambda: (index_of(base, name) or {}).get("state") == "ready", 300,
                 "the extra decode worker", [extra])
        for k in range(6):  # fresh prompts until one is decoded there
            prompt = prompt_ids(3 * B + 10, seed=7300 + k)
            _, receipt = complete(base, model_dir, prompt)
            if f"decode={name} " in receipt:
                break
        assert f"decode={name} " in receipt, receipt
        wait_for(lambda: index_of(base, name)["kv_index"]["blocks"] >= 3, 20,
                 "its engine's events in the index")
        old_pid = index_of(base, name)["pid"]
        extra.signal(signal.SIGKILL)  # the worker's group; its engine core follows it
        extra.proc.wait(30)
        extra = start_worker(name, "decode", pd_server, model_dir, logs)
        wait_for(lambda: (w := index_of(base, name)) is not None and w["pid"] != old_pid
                 and w["state"] == "ready", 300, "the restarted worker", [extra])
        assert index_of(base, name)["kv_index"]["blocks"] == 0
        # What the old engine held is no hit on the new one: the prompt is read whole again.
        reply, receipt = complete(base, model_dir, prompt)
        assert reply == complete(ref, model_dir, prompt)[0]
        assert receipt.startswith("disaggregated") and cached(receipt, "decode") == 0, receipt
    finally:
        extra.stop()


def test_a_controller_that_joins_late_learns_the_engine_by_replay(pd_server, reference,
                                                                 model_dir, logs, tmp_path):
    """A controller added to a decode worker's controller set mid-run never saw the engine's
    earlier KV events live: the gap its first live batch shows makes it ask the worker for a
    replay, which vLLM's replay socket serves, and it then routes on what the engine holds,
    as the controller that saw everything does."""
    from procs import Proc, free_port, pdserve, wait_for
    from test_pool import start_worker

    base, ref, name = pd_server.base, reference.base, "decode-0-late"  # sorts first: ties go to it
    B = get_json(base + "/pd/workers")[0]["block_size"]
    file = tmp_path / "controllers"
    file.write_text("")
    port, wport = free_port(), free_port()
    late = Proc("controller-late", pdserve(
        "controller", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
        "--worker-port", str(wport), "--keys", pd_server.keys,
        # Local prefill on (for no prompt: none is shorter than 1 token), so that this decode
        # worker alone is a pool it admits requests to.
        "--local-prefill-threshold", "1"), logs)
    other = f"http://127.0.0.1:{port}"
    extra = start_worker(name, "decode", pd_server, model_dir, logs, "--controllers-file",
                         str(file), "--discovery-interval", "0.5")
    try:
        wait_for(lambda: (index_of(base, name) or {}).get("state") == "ready", 300,
                 "the extra decode worker", [extra])

        def decoded_there(seed: int) -> list[int]:
            for k in range(6):  # fresh prompts until one is decoded there
                prompt = prompt_ids(3 * B + 10, seed=seed + k)
                _, receipt = complete(base, model_dir, prompt)
                if f"decode={name} " in receipt:
                    return prompt
            raise AssertionError(f"no prompt was decoded on {name}: {receipt}")

        held = decoded_there(7400)
        wait_for(lambda: index_of(base, name)["kv_index"]["blocks"] >= 3, 20,
                 "its engine's events in the first controller's index")
        # The second controller joins the worker's set; it has seen none of those events.
        wait_for(lambda: get_json(other + "/pd/workers") == [], 120, "the second controller",
                 [late])
        file.write_text(f"tcp://127.0.0.1:{wport}\n")
        wait_for(lambda: (index_of(other, name) or {}).get("state") == "ready", 30,
                 "the worker registered with the second controller", [late])
        decoded_there(7500)  # a live batch: the second controller sees what it missed
        first = lambda: index_of(base, name)["kv_index"]  # noqa: E731
        second = lambda: index_of(other, name)["kv_index"]  # noqa: E731
        wait_for(lambda: second()["blocks"] > 0 and not second()["waiting_for_replay"]
                 and second()["last_seq"] == first()["last_seq"], 30,
                 "the replay to fill the second controller's index")
        assert second()["blocks"] == first()["blocks"], (first(), second())
        assert second()["gaps"] >= 1  # it did learn through a replay
        # It routes on that: the worker is its only one, and its engine holds the prompt's
        # three blocks, so the rest (10 tokens) is prefilled there.
        reply, receipt = complete(other, model_dir, held)
        assert receipt.startswith("local (cached)") and f"decode={name} " in receipt, receipt
        assert cached(receipt, "decode") == 3 * B, receipt
        assert reply == complete(ref, model_dir, held)[0]
    finally:
        extra.stop()
        late.stop()
