"""`pdserve serve` as a user meets it: a short start (one line per child, the ready line, a request
to try), the children's logs in files, the built-in model's short name, errors that say what to
change, and Ctrl-C. The controller is real; the workers are fake (pdserve.fake) so that no engine
starts: a small driver runs the real command with `launcher.worker_command` swapped."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from procs import Proc, children, free_port, thread_cpus, wait_for

from pdserve import preflight
from pdserve.procfs import SHM, alive, tree
from pdserve.launcher import RUNS_KEPT, StartProgress, assign_cores, run_folder, try_it
from pdserve.supervisor import Child
from pdserve.worker.engine import parse_cores

FAKE_WORKERS = """
import sys
from pdserve import launcher

def fake(role, controller, model, cores, keys, extra):
    cmd = [sys.executable, "-m", "pdserve.fake", "worker", "--role", role,
           "--controller", controller, "--model", model]
    return cmd + (["--keys", keys] if keys else [])

launcher.worker_command = fake
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""
EXITING_WORKERS = """
import sys
from pdserve import launcher

launcher.worker_command = lambda *_: [
    sys.executable, "-c", "print('no such flag: --frobnicate'); raise SystemExit(2)"]
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""

# Workers that make a named semaphore a second in, as an engine does as it starts, and are killed
# with SIGKILL a few seconds later, with their group (its resource tracker too).
KILLED_STARTING_WORKERS = """
import sys
from pdserve import launcher

launcher.worker_command = lambda *_: [sys.executable, "-c", '''
import multiprocessing, os, signal, tempfile, time
time.sleep(1)
lock = multiprocessing.get_context("spawn").Lock()
print("semaphore", lock._semlock.name, flush=True)
print("tempfile", tempfile.mkstemp(prefix="vllm_dist_")[1], flush=True)  # vLLM's file store
time.sleep(4)
os.killpg(0, signal.SIGKILL)
''']
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def serve(*args: str, driver: str | None = None) -> list[str]:
    if driver is None:
        return [sys.executable, "-m", "pdserve.cli", "serve", *args]
    return [sys.executable, "-c", driver, "serve", *args]


def controller_cores(serve_pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of serve's controller."""
    [pid] = [p for p, cmd in children(serve_pid).items() if "pdserve.cli controller" in cmd]
    return thread_cpus(pid)


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_quiet_start_a_short_name_and_ctrl_c(tmp_path) -> None:
    port, wport = free_port(), free_port()
    runs = tmp_path / "run"
    p = Proc("serve", serve("--port", str(port), "--worker-port", str(wport), "--log-dir",
                            str(runs), driver=FAKE_WORKERS), tmp_path)
    try:
        wait_for(lambda: "pdserve ready" in p.log(), 300, "pdserve serve", [p])
        base = f"http://127.0.0.1:{port}"
        status, body = post(base + "/v1/completions",
                            {"model": "tiny", "prompt": "def main(", "max_tokens": 4})
        assert status == 200 and body["model"] == "tiny", body
        assert len(body["choices"][0]["text"]) > 0
        status, body = post(base + "/v1/completions",
                            {"model": "llama", "prompt": "x", "max_tokens": 2})
        assert status == 404 and "llama" in json.dumps(body), body
        kept_to = controller_cores(p.proc.pid)
        start = time.monotonic()
        p.signal(signal.SIGINT)
        p.proc.wait(60)
        stop_s = time.monotonic() - start
    finally:
        p.stop()
    out = p.log()
    lines = out.splitlines()
    print(out)
    ready = [ln for ln in lines if ln.startswith("pdserve ready: ")]
    assert ready == [ln for ln in lines if "pdserve ready" in ln]
    assert ready[0].startswith(f"pdserve ready: http://127.0.0.1:{port}/v1  (1 prefill, 1 decode")
    # The start, one line per step, each child named once when it starts and once when it is up.
    start = lines[:lines.index(ready[0])]
    assert start[0] == f"pdserve: logs in {runs}"
    for child, up in (("controller", "up"), ("prefill-1", "ready"), ("decode-1", "ready")):
        assert sum(ln.startswith(f"pdserve: {child} ") for ln in start) == 2, (child, start)
        assert any(ln.startswith(f"pdserve: {child} {up} (") and ln.endswith(" s)")
                   for ln in start), (child, start)
    assert len(start) == 7, start  # nothing of the children's own output
    # The controller keeps to the prefill worker's cores, away from the decode engine's steps.
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) >= 2:
        prefill_cores = assign_cores(2, mine)[0]
        assert kept_to == {frozenset(parse_cores(prefill_cores))}, kept_to
        assert f"pdserve: controller starting ({base}, cores {prefill_cores})" in start
    else:
        assert kept_to == {frozenset(mine)}, kept_to
    assert '"model": "tiny"' in out and f"curl http://127.0.0.1:{port}/v1/completions" in out
    # Ctrl-C says so, and stops it all in seconds.
    assert p.proc.returncode == 0 and stop_s < 30, (p.proc.returncode, stop_s)
    assert lines[-2].startswith("pdserve: stopping (Ctrl-C): new requests are refused, the "
                                "streams in flight finish, then the workers drain")
    assert lines[-1].startswith("pdserve: stopped in ")
    # The children's logs went to the run folder, without serve's own polling.
    logs = {f.name: f.read_text() for f in runs.iterdir()}
    assert set(logs) == {"controller.log", "prefill-1.log", "decode-1.log"}
    assert "pdserve controller serving on" in logs["controller.log"]
    assert "POST /v1/completions" in logs["controller.log"]
    assert "GET /pd/workers" not in logs["controller.log"]
    assert "registered with controller" in logs["decode-1.log"]


def test_systemds_stop_of_every_process_lets_a_stream_finish(tmp_path) -> None:
    """systemd's default stop (KillMode=control-group) sends SIGTERM to serve, the controller and
    every worker at once. serve's own stop must not be a worker's second signal (stop at once:
    with one decode worker the stream would have nowhere to go)."""
    from pdserve.procfs import tree

    port, wport = free_port(), free_port()
    driver = FAKE_WORKERS.replace('"--model", model]', '"--model", model, "--decode-delay", "0.02"]')
    p = Proc("serve", serve("--port", str(port), "--worker-port", str(wport), "--log-dir",
                            str(tmp_path / "run"), driver=driver), tmp_path)
    try:
        wait_for(lambda: "pdserve ready" in p.log(), 300, "pdserve serve", [p])
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "tiny", "prompt": "def main(", "max_tokens": 150,
                             "ignore_eos": True, "stream": True,
                             "stream_options": {"include_usage": True}}).encode())
        chunks = []
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 5:  # streaming: now stop the unit
                        for pid in tree(p.proc.pid):
                            os.kill(pid, signal.SIGTERM)
        p.proc.wait(60)
    finally:
        p.stop()
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length" and chunks[-1]["usage"]["completion_tokens"] == 150, chunks[-3:]
    assert p.proc.returncode == 0, p.log()
    decode = (tmp_path / "run" / "decode-1.log").read_text()
    assert "SIGTERM: draining" in decode and "stopping now" not in decode, decode


def stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, list[dict]]:
    """Stream `body` from a thread; the chunks go into the list as they come."""
    chunks: list[dict] = []

    def read() -> None:
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            chunks.extend(json.loads(ln[6:]) for ln in r if ln.startswith(b"data: {"))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t, chunks


def ctrl_c(p: Proc) -> None:
    p.signal(signal.SIGINT)  # serve's process group, as a terminal sends it


def hangup(p: Proc) -> None:
    p.signal(signal.SIGHUP)  # the terminal closed (its children have sessions of their own)


def systemd_stop(p: Proc) -> None:
    """systemd's default stop (KillMode=control-group): SIGTERM to every process at once."""
    for pid in tree(p.pid):
        os.kill(pid, signal.SIGTERM)


def kill_9(p: Proc) -> None:
    os.kill(p.pid, signal.SIGKILL)  # serve alone: its children stop themselves


@pytest.mark.parametrize("stop, code", [(ctrl_c, 0), (hangup, 0), (systemd_stop, 0),
                                        (kill_9, -signal.SIGKILL)],
                         ids=["ctrl-c", "hangup", "systemd", "kill-9"])
def test_a_stop_refuses_new_requests_and_finishes_one_between_its_prefill_and_decode(
        stop, code, tmp_path) -> None:
    """The controller refuses new requests (it stops listening; a request that got in
    meanwhile gets a 503), a request whose prefill was running when the stop came is decoded
    to its end, and then every process serve started is gone.

    Ctrl-C: serve stops the front first, while the workers still take the legs of those in
    flight. (Draining the workers first had the decode worker refuse its decode leg, and the
    stream stopped after its first token.) systemd's stop drains every worker at the same
    moment: the prefill worker stays up for its prefill's KV and, with no decode worker left
    to take it, goes on from it itself. (Before, the request ended with finish reason "abort"
    after its first token.) A hangup (SIGHUP) used to end serve at once and leave the rest
    running, as kill -9 of serve still ends serve: its children then stop as if serve had
    stopped them all at once, as systemd's stop does."""
    port, wport = free_port(), free_port()
    driver = FAKE_WORKERS.replace(
        '"--model", model]', '"--model", model, "--decode-delay", "0.02", '
        '"--prefill-delay-per-token", "0.003"]')
    p = Proc("serve", serve("--port", str(port), "--worker-port", str(wport), "--log-dir",
                            str(tmp_path / "run"), driver=driver), tmp_path)
    url = f"http://127.0.0.1:{port}/v1/completions"
    started: list[int] = []
    try:
        wait_for(lambda: "pdserve ready" in p.log(), 300, "pdserve serve", [p])
        t, chunks = stream_in_thread(url, {
            "model": "tiny", "prompt": list(range(5, 1005)), "max_tokens": 40,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        time.sleep(1.0)  # 1,000 prompt tokens at 3 ms each: the prefill is running
        assert not chunks
        started += tree(p.pid)[1:]
        assert len(started) == 3, started  # the controller and two workers
        stop(p)
        time.sleep(0.5)
        try:  # the controller stops listening as it stops (server.stop_listening)
            status = post(url, {"model": "tiny", "prompt": "def main(", "max_tokens": 4})[0]
        except urllib.error.URLError as e:
            status = type(e.reason).__name__
        t.join(60)
        p.proc.wait(60)
        wait_for(lambda: not any(alive(pid) for pid in started), 60, "serve's children to exit")
    finally:
        p.stop()
        for pid in started:  # what a failed stop left (each child leads its process group)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    assert status in (503, "ConnectionRefusedError"), status
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length" and chunks[-1]["usage"]["completion_tokens"] == 40, chunks[-3:]
    assert p.proc.returncode == code, p.log()


def serve_to_the_end(logs, driver: str) -> subprocess.CompletedProcess:
    """`pdserve serve` with `driver`'s workers on free ports, logs in `logs`, until it exits."""
    return subprocess.run(serve("--port", str(free_port()), "--worker-port", str(free_port()),
                                "--log-dir", str(logs), driver=driver),
                          capture_output=True, text=True, timeout=120)


def test_a_child_that_exits_during_start_up_ends_serve_with_its_log(tmp_path) -> None:
    proc = serve_to_the_end(tmp_path / "run", EXITING_WORKERS)
    assert proc.returncode == 1, proc.stderr
    assert "exited with code 2 during start-up" in proc.stderr
    assert "no such flag: --frobnicate" in proc.stderr  # the end of its log


def test_a_worker_killed_while_it_starts_leaves_nothing_behind(tmp_path) -> None:
    """kill -9 of a starting worker's group (a stuck start, say) ends serve, as any exit during
    start-up does; the semaphore and the temporary file it made are removed, with nothing else
    left to do it."""
    proc = serve_to_the_end(tmp_path / "run", KILLED_STARTING_WORKERS)
    assert proc.returncode == 1, proc.stderr
    assert "exited with code -9 during start-up" in proc.stderr
    made = {kind: [line.split()[1] for log in (tmp_path / "run").glob("*-1.log")
                   for line in log.read_text().splitlines() if line.startswith(kind + " ")]
            for kind in ("semaphore", "tempfile")}
    sems = [SHM / f"sem.{m.lstrip('/')}" for m in made["semaphore"]]
    files = [Path(f) for f in made["tempfile"]]
    assert sems and files  # at least the worker that was killed made them
    try:
        assert [f for f in sems + files if f.exists()] == []
    finally:
        for f in sems + files:
            f.unlink(missing_ok=True)


def test_a_taken_port_fails_at_once_saying_what_to_change(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(serve("--port", str(port), "--worker-port", str(free_port()),
                                    "--log-dir", str(tmp_path / "run")),
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - start < 15
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"pdserve serve: port {port} on 127.0.0.1 is in use by another program (another "
        "pdserve?): stop it, or choose a free port with --port"]
    assert not (tmp_path / "run").exists()  # nothing was started


@pytest.mark.skipif(not preflight.cpu_build(), reason="the memory check is for CPU hosts")
def test_too_little_memory_fails_at_once_saying_what_to_change(tmp_path) -> None:
    proc = subprocess.run(serve("--prefill", "500", "--decode", "500", "--port", str(free_port()),
                                "--worker-port", str(free_port())),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line.startswith("pdserve serve: not enough memory: 1000 worker(s) need about ")
    assert line.endswith("start fewer workers (--prefill, --decode)")


class _Proc:
    def __init__(self, pid: int):
        self.pid = pid


def test_start_progress_names_each_child_once_it_is_up() -> None:
    import io

    now = [100.0]
    out = io.StringIO()
    progress = StartProgress(out, clock=lambda: now[0])
    children = [Child("controller", _Proc(1)), Child("prefill-1", _Proc(2)),
                Child("decode-1", _Proc(3))]
    now[0] += 9.4
    progress.seen([], children)
    now[0] += 30
    progress.seen([{"pid": 2, "state": "ready"}, {"pid": 3, "state": "suspect"}], children)
    progress.seen([{"pid": 2, "state": "ready"}, {"pid": 3, "state": "ready"}], children)
    assert out.getvalue().splitlines() == ["pdserve: controller up (9 s)",
                                           "pdserve: prefill-1 ready (39 s)",
                                           "pdserve: decode-1 ready (39 s)"]


def test_the_request_to_try_quotes_the_model_for_the_shell() -> None:
    line = try_it("http://127.0.0.1:8000", "/models/it's here").splitlines()[0]
    words = shlex.split(line.removeprefix("  try: "))
    assert words[:2] == ["curl", "http://127.0.0.1:8000/v1/completions"]
    assert json.loads(words[words.index("-d") + 1])["model"] == "/models/it's here"


def test_run_folders_keep_the_newest_and_nothing_else(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    runs = tmp_path / "runs"
    old = [runs / f"20250101-0000{i:02d}-1" for i in range(RUNS_KEPT + 5)]
    for d in old:
        d.mkdir(parents=True)
    (runs / "mine").mkdir()
    new = run_folder(None)
    assert new.parent == runs and new.is_dir()
    left = sorted(p.name for p in runs.iterdir())
    assert len(left) == RUNS_KEPT + 1 and "mine" in left and new.name in left
    assert not old[5].exists() and old[6].exists()
    assert run_folder(str(tmp_path / "given")) == tmp_path / "given"


def test_a_controller_kept_to_cores_it_may_not_use_says_which_it_may() -> None:
    mine = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    beyond = str(max(os.sched_getaffinity(0)) + 1000)
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "controller", "--cores", beyond],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r
    assert f"--cores {beyond}: none of CPUs {beyond} is one this process may use (it may use " \
           f"{mine})" in r.stderr, r.stderr


HANGUP = """
import os, signal, sys, time
from pdserve.cli import stop_on_hangup
if sys.argv[1] == "nohup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM", flush=True))
stop_on_hangup()
os.kill(os.getpid(), signal.SIGHUP)
time.sleep(0.5)
print("still here", flush=True)
"""


STACKS = """
import os, threading, time
from pdserve.cli import STACKS_SIGNAL, stacks_on_signal
def another_thread(stop):
    stop.wait()
def main_thread():
    stop = threading.Event()
    threading.Thread(target=another_thread, args=(stop,)).start()
    stacks_on_signal()
    os.kill(os.getpid(), STACKS_SIGNAL)
    time.sleep(0.5)
    stop.set()
    print("still here", flush=True)
main_thread()
"""


def test_sigusr2_prints_every_threads_stack_and_the_process_goes_on() -> None:
    """serve, the controller and a worker print where each of their threads is on SIGUSR2 (its
    default would end them): what a stuck one waits for, seen without stopping it."""
    out = subprocess.run([sys.executable, "-c", STACKS], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["still", "here"]
    assert "in main_thread" in out.stderr and "in another_thread" in out.stderr, out.stderr


@pytest.mark.parametrize("how", ["terminal", "nohup"])
def test_a_hangup_stops_a_command_as_sigterm_does_unless_under_nohup(how) -> None:
    """serve, the controller and a worker take SIGHUP (their terminal closed) as SIGTERM, their
    stop that finishes what is in flight; its default would end them at once."""
    out = subprocess.run([sys.executable, "-c", HANGUP, how], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == (["SIGTERM", "still", "here"] if how == "terminal"
                                  else ["still", "here"])
