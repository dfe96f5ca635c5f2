"""Two controllers over one 1P1D pool of real engines (`pdserve serve --api-servers 2`): requests
through both at once equal one engine's; kill -9 of one controller mid-stream leaves the other's
streams whole, and the workers free the killed one's legs: 0 running and idle KV afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from procs import Proc, children, free_port, free_ports, get_json, pdserve, wait_for
from test_openai import prompt_ids

from pdserve.cli import STACKS_SIGNAL

DEAD_AFTER = 6  # the controllers': workers drop a silent controller's legs after it
HEADER = "x-pdserve-controller"
REGISTERED = re.compile(r"pdserve controller (controller-[0-9a-f]+): workers register at "
                        r"tcp://[^:]+:(\d+)")


@pytest.fixture(scope="module")
def two(model_dir, logs, keys):
    wport = free_ports(2)  # API server i takes wport + i
    port = next(q for q in iter(free_port, None) if q not in (wport, wport + 1))
    p = Proc("serve-two", pdserve("serve", "--verbose", "--model", model_dir, "--port", str(port),
                                  "--worker-port", str(wport), "--keys", keys,
                                  "--api-servers", "2",
                                  f"--controller-arg=--dead-after={DEAD_AFTER}"), logs)
    try:
        try:
            wait_for(lambda: "pdserve ready" in p.log(), 400, "pdserve serve --api-servers 2",
                     [p])
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{how_the_start_stands(p)}") from None
        yield p, f"http://127.0.0.1:{port}", wport
    finally:
        p.stop(90)


def stream(base: str, model: str, prompt: list[int], max_tokens: int,
           seen: list[str] | None = None) -> dict:
    """A streamed greedy completion: its controller (also put in `seen` as soon as it is
    known), token ids and finish, or the error."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"content-type": "application/json"})
    out: dict = {"controller": "", "ids": [], "finish": None, "error": None, "done": False}
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out["controller"] = r.headers.get(HEADER, "")
            if seen is not None:
                seen.append(out["controller"])
            for line in r:
                line = line.strip()
                if line == b"data: [DONE]":
                    out["done"] = True
                elif line.startswith(b"data: "):
                    ch = json.loads(line[6:])["choices"][0]
                    out["ids"] += ch.get("token_ids") or []
                    out["finish"] = ch.get("finish_reason") or out["finish"]
    except (OSError, ValueError) as e:  # the connection cut: what a killed controller's
        out["error"] = repr(e)  # clients see (a stream without [DONE] counts too)
    return out


def api_server_pid(serve_log: str, controller_id: str, base_port: int) -> int:
    """The pid of the API server process that is `controller_id` (by its worker port)."""
    ports = {cid: int(p) for cid, p in REGISTERED.findall(serve_log)}
    index = ports[controller_id] - base_port
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if (b"--api-server-index" in args and args[args.index(b"--api-server-index") + 1]
                == str(index).encode() and str(base_port).encode() in args):
            return int(pid)
    raise AssertionError(f"no API server process for {controller_id}")


def pdserve_processes(serve: int) -> dict[int, str]:
    """serve's descendants that run pdserve's command line, with their command lines: the
    controller, its API servers and the workers (not the engine cores: SIGUSR2 would end them)."""
    found, todo = {}, [serve]
    while todo:
        kids = children(todo.pop())
        found.update(kids)
        todo += kids
    return {pid: cmd for pid, cmd in found.items() if " pdserve.cli " in cmd}


def how_the_start_stands(p: Proc) -> str:
    """What serve's processes said of their start and of registering (the periodic pool lines
    would hide it), and the stacks of their threads now: SIGUSR2 has serve, the controllers and
    the workers print them (pdserve.cli)."""
    log = p.log().splitlines()
    said = [ln for ln in log if re.search(r"regist|refused|joined|bind|Error| up: |answer|"
                                          r"^pdserve|Warming up|KV cache size|connector:", ln)]
    out = ["--- start and registration lines ---", *said[-60:]]
    for pid, cmd in {p.proc.pid: "pdserve.cli serve", **pdserve_processes(p.proc.pid)}.items():
        before = len(p.log())
        os.kill(pid, STACKS_SIGNAL)
        time.sleep(0.5)  # one at a time: their stacks would mix in the one log
        which = re.findall(r"pdserve\.cli (\w+)|--(?:role|api-server-index) (\S+)", cmd)
        out.append(f"--- the threads of pid {pid}: {' '.join(''.join(w) for w in which)}")
        out += [ln for ln in p.log()[before:].splitlines()
                if re.match(r"(Current t|T)hread 0x|  File ", ln)]
    return "\n".join(out)


def test_two_controllers_serve_one_pool_and_survive_each_other(two, reference, model_dir):
    p, base, wport = two
    # The kernel spreads new connections over the two by a hash: 8 all went to one once (a
    # 1-in-128 chance); with 12, 1 in 2,048.
    prompts = [prompt_ids(200 + 37 * i, seed=7300 + i) for i in range(12)]
    with ThreadPoolExecutor(12) as ex:
        got = list(ex.map(lambda pr: stream(base, model_dir, pr, 24), prompts))
        want = list(ex.map(lambda pr: stream(reference.base, model_dir, pr, 24), prompts))
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    assert all(g["done"] and g["finish"] == "length" for g in got)
    assert len({g["controller"] for g in got}) == 2, "both API servers answered"

    # Long streams on both; kill -9 the controller of the first one.
    seen: list[str] = []
    with ThreadPoolExecutor(16) as ex:
        runs = []
        # The kernel spreads connections over the two; a few more if all went to one.
        while len(runs) < 8 or (len(set(seen)) < 2 and len(runs) < 16):
            runs.append(ex.submit(stream, base, model_dir,
                                  prompt_ids(150, seed=7400 + len(runs)), 400, seen))
            if len(runs) >= 8:
                wait_for(lambda: len(seen) == len(runs), 60, "the streams to start")
        time.sleep(0.5)
        victim_id = seen[0]
        os.kill(api_server_pid(p.log(), victim_id, wport), signal.SIGKILL)
        results = [r.result() for r in runs]
    survivors = [r for r in results if r["controller"] != victim_id]
    cut = [r for r in results if r["controller"] == victim_id]
    assert survivors and cut, "streams ran on both controllers"
    for r in survivors:  # whole: every token, a finish, [DONE]
        assert r["error"] is None and r["done"] and r["finish"] == "length" and len(r["ids"]) == 400
    for r in cut:
        assert r["error"] is not None or not r["done"]
    # The workers free the killed controller's legs after its dead_after: nothing runs, no KV
    # is held (the other controller's view, or the restarted one's: they agree).
    wait_for(lambda: all(w["running"] == 0 and w["waiting"] == 0 and w["kv_usage"] == 0
                         for w in get_json(base + "/pd/workers")), 3 * DEAD_AFTER + 30,
             "the workers to free the killed controller's requests")
