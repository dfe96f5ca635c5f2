"""More engines than cores, and no `--cores` anywhere: a controller with one prefill and two
decode workers started as a user who forgot the flag would, beside the `pd_server`'s two pinned
engines (five engines on two cores). Each worker claims a core by itself (sharing the least
claimed one, with one compute thread) and says so; the pool starts, serves long prompts under
load for minutes with outputs equal to one plain engine, and no live worker is declared dead and
no worker aborts a controller's requests because its own replies were late.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from procs import Proc, free_port, get_json, pdserve, wait_for
from test_engine_chaos import metric
from test_openai import complete, prompt_ids
from test_pool import get_text

LOAD_S = 120.0
CLIENTS = 3
ROLES = {"prefill-oc": "prefill", "decode-oc-1": "decode", "decode-oc-2": "decode"}


@pytest.fixture(scope="module")
def unpinned_pool(pd_server, model_dir, logs, keys):
    port, wport = free_port(), free_port()
    ctl = Proc("controller-overcommit", pdserve(
        "controller", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
        "--worker-port", str(wport), "--keys", keys), logs)
    procs = [ctl] + [Proc(name, pdserve("worker", "--role", role, "--worker-id", name,
                                        "--controller", f"tcp://127.0.0.1:{wport}",
                                        "--keys", keys, "--model", model_dir,
                                        "--advertise-host", "127.0.0.1"), logs)
                     for name, role in ROLES.items()]
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: sum(w["state"] == "ready" for w in get_json(base + "/pd/workers"))
                 == len(ROLES), 900, "three unpinned workers", procs)
        yield base, ctl, procs[1:]
    finally:
        for p in procs[1:]:
            p.stop(60)
        ctl.stop()


def test_workers_without_cores_claim_one_and_say_which(unpinned_pool):
    _, _, workers = unpinned_pool
    for w in workers:
        lines = [ln for ln in w.log().splitlines() if "no --cores" in ln]
        assert len(lines) == 1, w.name
        assert re.search(r"(took|sharing) core \d+", lines[0]), lines[0]


def test_overcommitted_pool_serves_long_prompts_without_false_verdicts(unpinned_pool, ref_client,
                                                                      model_dir):
    import openai

    base, ctl, workers = unpinned_pool
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=300, max_retries=0)
    prompts = [prompt_ids(n, 17_000 + n) for n in (900, 1100, 1300, 1500, 1700, 1900)]
    refs = [complete(ref_client, model_dir, p, max_tokens=48, temperature=0)[0] for p in prompts]
    results: list[str] = []
    stop_at = time.monotonic() + LOAD_S

    def client_loop(k: int) -> None:
        i = k
        while time.monotonic() < stop_at:
            i += 1
            p = i % len(prompts)
            try:
                ours, _ = complete(client, model_dir, prompts[p], max_tokens=48, temperature=0)
                results.append("ok" if ours == refs[p] else "wrong")
            except Exception as e:  # noqa: BLE001 - counted below
                results.append(f"error {e}")

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LOAD_S + 300)
    text = get_text(base + "/metrics")
    cleared = metric(text, "pdserve_worker_suspicions_total", '{outcome="cleared"}')
    dead = metric(text, "pdserve_worker_suspicions_total", '{outcome="dead"}')
    dead_lines = [ln for ln in ctl.log().splitlines() if " is dead" in ln]
    aborted = [ln for w in workers for ln in w.log().splitlines() if "aborting its" in ln]
    print(f"\novercommit: 5 engines on 2 cores, {CLIENTS} clients, {LOAD_S:.0f} s of "
          f"900-1900-token prompts: {results.count('ok')} correct, {results.count('wrong')} "
          f"wrong, {sum(r.startswith('error') for r in results)} failed; suspicions cleared "
          f"{cleared:.0f}, dead verdicts {len(dead_lines)} (metric {dead:.0f}), requests aborted "
          f"by workers {len(aborted)}")
    assert results and all(r == "ok" for r in results), sorted(set(results))[:5]
    assert dead_lines == [] and dead == 0
    assert aborted == []
