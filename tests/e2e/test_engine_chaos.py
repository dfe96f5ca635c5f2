"""Chaos with real engines (issue 4, item 6; the fake-engine version at scale is
tests/control/test_chaos.py).

Steady greedy load against the 1P1D `pd_server` plus an extra decode worker (core 1) and an extra
prefill worker (core 0), while the extras are killed with SIGKILL (their whole process group;
the engine core, in a group of its own, follows its worker) in the middle of their work and
restarted under the same id. The pd_server's own prefill and decode workers stay alive, so a
worker of each role is always there: every request must complete with exactly the plain engine's
output; none may fail, and none may be lost (each returns within a bound).
"""

from __future__ import annotations

import random
import re
import signal
import threading
import time
from collections import Counter

import openai
from procs import get_json, remove_shm_left, shm_of, wait_for
from test_openai import complete, prompt_ids, stream_complete
from test_pool import get_text, start_worker, workers

LENGTHS = [5, 60, 127, 129, 300, 700, 1200]
MAX_TOKENS = (8, 120, 200)
# Some cases constrain the sampler as real clients do: a stream migrated off a killed engine
# must go on under the same penalties and grammar state (tokens already out still count).
CONSTRAINTS = ({}, {"presence_penalty": 0.8, "frequency_penalty": 0.4},
               {"extra_body": {"structured_outputs": {"regex": "[a-z ]{1,400}"}}})
# Half the requests bring a prompt never sent before: repeated prompts alone end up held by the
# decode engines, which then serve them without a prefill, and the prefill workers go idle.
FRESH = 0.5
CLIENTS = 3
THINK_S = (0.3, 1.0)  # a pause between a client's requests: steady load, not a saturated one
# (engines restarting on cores that are busy without a break took 4-6 minutes to come up here)
REQUEST_TIMEOUT = 120.0  # a request that has not returned by then is lost
EXTRA = {"decode": "decode-0-chaos", "prefill": "prefill-0-chaos"}  # sort first: chosen on ties
CORES = {"decode": "1", "prefill": "0"}
# Victims in order; each is killed once it has work in flight, and restarted at once (the
# prefill right after the decode: both restart under load at the same time).
KILLS = ["decode", "prefill", "decode"]
AFTER_LAST_KILL_S = 10.0  # load goes on this long after the last kill


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def counters(base: str) -> dict[str, float]:
    t = get_text(base + "/metrics")
    return {
        "recovered": metric(t, "pdserve_requests_recovered_total"),
        "migrations": metric(t, "pdserve_retries_total", '{kind="migration"}'),
        "prefill retries": metric(t, "pdserve_retries_total", '{kind="prefill_retry"}'),
        "failed (controller)": metric(t, "pdserve_requests_total", '{outcome="failed"}'),
    }


def pool_summary(pd_server) -> list[tuple]:
    return [(w["id"], w["state"], w["inflight"], w["legs_total"])
            for w in workers(pd_server).values()]


def test_kill_9_and_restart_under_load(pd_server, pd_client, ref_client, model_dir, logs):
    base = pd_server.base
    rng = random.Random(777)
    cases = [(prompt_ids(n, seed=60_000 + k), mt, CONSTRAINTS[k % len(CONSTRAINTS)])
             for k, (n, mt) in enumerate((n, mt) for n in LENGTHS for mt in MAX_TOKENS)]
    refs = [complete(ref_client, model_dir, p, max_tokens=mt, temperature=0, **kw)[0][0]
            for p, mt, kw in cases]

    procs: dict[str, object] = {}
    starts = Counter()

    def spawn(role: str):
        starts[role] += 1
        procs[role] = start_worker(f"{EXTRA[role]}-{starts[role]}", role, pd_server, model_dir,
                                   logs, "--worker-id", EXTRA[role], "--cores", CORES[role])

    def ready(role: str) -> bool:
        return workers(pd_server).get(EXTRA[role], {}).get("state") == "ready"

    counts = Counter()
    lock = threading.Lock()
    failures: list[str] = []

    def count(key: str, failure: str | None = None) -> None:
        with lock:
            counts[key] += 1
            if failure:
                failures.append(failure)
    stop = threading.Event()
    client = openai.OpenAI(base_url=pd_server.v1, api_key="none", timeout=REQUEST_TIMEOUT,
                           max_retries=0)

    longest = [0.0]
    fresh: list[tuple[str, list[int], int, dict, tuple]] = []  # checked after the load

    def judge(name: str, got: str, ref: str) -> None:
        if got == ref:
            count("correct")
        else:
            count("wrong", f"{name}: {got!r} != {ref!r}")

    def load(k: int) -> None:
        r = random.Random(k)
        made = 0
        while not stop.wait(r.uniform(*THINK_S)):
            if r.random() < FRESH:
                made += 1
                seed = 100_000 + 1_000 * k + made
                prompt, mt = prompt_ids(r.choice(LENGTHS[1:]), seed=seed), r.choice(MAX_TOKENS)
                kw, name, ref = r.choice(CONSTRAINTS), f"fresh prompt {seed}", None
            else:
                i = r.randrange(len(cases))
                (prompt, mt, kw), name, ref = cases[i], f"case {i}", refs[i]
            count("sent")
            t0 = time.monotonic()
            try:
                if r.random() < 0.5:
                    got = stream_complete(client, model_dir, prompt, max_tokens=mt,
                                          temperature=0, **kw)
                else:
                    got = complete(client, model_dir, prompt, max_tokens=mt, temperature=0,
                                   **kw)[0][0]
            except openai.APITimeoutError:
                count("lost", f"{name}: no answer after {REQUEST_TIMEOUT:.0f} s")
                continue
            except openai.APIError as e:
                count("failed", f"{name}: {type(e).__name__}: {e}")
                continue
            if ref is None:
                with lock:
                    fresh.append((name, prompt, mt, kw, got))
            else:
                judge(name, got, ref)
            with lock:
                longest[0] = max(longest[0], time.monotonic() - t0)

    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(CLIENTS)]
    before = counters(base)
    t_start = time.monotonic()
    killed_shm: set[str] = set()  # /dev/shm files the killed processes used
    try:
        spawn("decode")
        spawn("prefill")
        for role in ("decode", "prefill"):
            wait_for(lambda role=role: ready(role), 400, f"the extra {role} worker",
                     [procs[role]])
        for t in threads:
            t.start()
        for role in KILLS:
            wait_for(lambda role=role: ready(role), 400, f"the extra {role} worker to be back",
                     [procs[role]])
            try:
                wait_for(lambda role=role: workers(pd_server)[EXTRA[role]]["inflight"] > 0, 120,
                         f"work on the extra {role} worker", [procs[role]])
            except TimeoutError as e:
                raise TimeoutError(f"{e}\nthe pool: {pool_summary(pd_server)}") from None
            if role == "decode":
                time.sleep(rng.uniform(0.0, 0.4))  # somewhere in its streams
            killed_shm |= shm_of(procs[role].pid)
            procs[role].signal(signal.SIGKILL)  # the group: worker and engine processes
            procs[role].proc.wait(30)
            procs[role].stop()  # closes its log
            counts[f"killed {role}"] += 1
            wait_for(lambda role=role: workers(pd_server)[EXTRA[role]]["state"] == "dead", 15,
                     f"the controller to see the {role} worker dead")
            spawn(role)  # the same worker id: it replaces its dead entry
        time.sleep(AFTER_LAST_KILL_S)
        stop.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT + 30)
        elapsed = time.monotonic() - t_start
        for name, prompt, mt, kw, got in fresh:
            judge(name, got, complete(ref_client, model_dir, prompt, max_tokens=mt,
                                      temperature=0, **kw)[0][0])
        # The last restarts come up (faster without the load) and take work again.
        for role in ("decode", "prefill"):
            wait_for(lambda role=role: ready(role), 400, f"the extra {role} worker to be back",
                     [procs[role]])
        legs = {r: workers(pd_server)[EXTRA[r]]["legs_total"] for r in EXTRA}
        # Every case once more, on engines whose prefix caches the load filled: a read that
        # put KV in the wrong blocks would show here too, in the answers of later requests.
        wrong = [i for i, (prompt, mt, kw) in enumerate(cases)
                 if complete(pd_client, model_dir, prompt, max_tokens=mt,
                             temperature=0, **kw)[0][0] != refs[i]]
        assert not wrong, f"cases {wrong} differ from the plain engine after the load"
        served = {r: workers(pd_server)[EXTRA[r]]["legs_total"] - legs[r] for r in EXTRA}
        print(f"\nlegs served by the restarted extra workers: {served}")
    finally:
        stop.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT + 30)
        for p in procs.values():
            p.stop()
        print(f"\n/dev/shm files the killed processes left, removed: {remove_shm_left(killed_shm)}")
    after = counters(base)
    delta = {k: after[k] - before[k] for k in after}
    hung = sum(t.is_alive() for t in threads)
    print(f"\nchaos over {elapsed:.0f} s, {CLIENTS} clients: sent {counts['sent']} "
          f"({len(fresh)} fresh), correct "
          f"{counts['correct']}, recovered {delta['recovered']:.0f} (migrations "
          f"{delta['migrations']:.0f}, prefill retries {delta['prefill retries']:.0f}), failed "
          f"{counts['failed']}, wrong {counts['wrong']}, lost {counts['lost'] + hung}; killed "
          f"{counts['killed decode']} decode + {counts['killed prefill']} prefill; longest "
          f"request {longest[0]:.1f} s")
    assert hung == 0
    assert not failures, "\n".join(failures[:10])
    assert counts["correct"] == counts["sent"] > 0
    assert delta["failed (controller)"] == 0
    assert delta["migrations"] + delta["prefill retries"] >= 1  # the kills did hit requests
    assert all(served.values()), served

    # The survivors end with nothing held: no leg, no request, no block.
    complete(pd_client, model_dir, [7, 8, 9], max_tokens=2, temperature=0)
    wait_for(lambda: all(w["running"] == w["waiting"] == w["inflight"] == 0
                         and w["kv_usage"] == 0.0
                         for w in get_json(base + "/pd/workers") if w["state"] == "ready"),
             20, "the surviving workers to be idle")
