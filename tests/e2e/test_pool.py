"""Dynamic XpYd with real engines: workers join a running 1P1D, drain on SIGTERM, die with
kill -9, and a worker on another model is refused."""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
from pdserve.leftovers import shared_torch_cache
from pdserve.procfs import tree
from procs import (Proc, engine_core_pid, exited, free_port, get_json, pdserve, thread_cpus,
                   wait_for)
from test_openai import complete, prompt_ids


def start_worker(name, role, pd_server, model_dir, logs, *extra, env=None):
    return Proc(name, pdserve("worker", "--role", role, "--worker-id", name,
                              "--controller", f"tcp://127.0.0.1:{pd_server.worker_port}",
                              "--keys", pd_server.keys, "--model", model_dir,
                              "--advertise-host", "127.0.0.1", "--heartbeat-interval", "0.5",
                              # Pinned like the launcher pins its engines: an unpinned CPU
                              # engine (vLLM's "auto" binding) beside pinned ones stalled
                              # its KV reads here until the prefill's lease ran out.
                              "--cores", "1", *extra), logs, env)


def streams_at_once(pd_client, model_dir, prompt, max_tokens, n=2):
    """`n` greedy completions of `prompt` started at once: their answers by index (filled in
    as they end) and the threads to join."""
    result: dict[int, list] = {}

    def run(k):
        result[k] = complete(pd_client, model_dir, prompt, max_tokens=max_tokens,
                             temperature=0)[0]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    return result, threads


def workers(pd_server) -> dict[str, dict]:
    return {w["id"]: w for w in get_json(pd_server.base + "/pd/workers")}


@pytest.fixture()
def short_tmp():
    """An empty temporary folder as short as a host's usual one: the paths of vLLM's sockets in
    a worker's folder in it must fit in 107 bytes (in the suite's own folder they may not)."""
    folder = Path(tempfile.mkdtemp(prefix="pdserve-test-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_added_decode_worker_shares_the_load_then_drains(pd_server, pd_client, ref_client,
                                                         model_dir, logs, short_tmp):
    # Started as an operator starts one, with vLLM's sockets left to their default (the suite
    # places them): the worker keeps its temporary files in a folder of its own.
    tmp_path = short_tmp
    temp = {"TMPDIR": str(tmp_path), "VLLM_RPC_BASE_PATH": "",
            # torch's compile cache where the suite's engines share it (its default is in TMPDIR)
            "TORCHINDUCTOR_CACHE_DIR": shared_torch_cache()}
    # "decode-0..." sorts first, so on equal load the new worker is chosen.
    extra = start_worker("decode-0-extra", "decode", pd_server, model_dir, logs, env=temp)
    try:
        wait_for(lambda: workers(pd_server).get("decode-0-extra", {}).get("state") == "ready",
                 300, "the new decode worker", [extra])
        made = list(tmp_path.iterdir())
        assert [p.name.startswith(f"pdserve-worker-{extra.pid}-") for p in made] == [True], made
        own, = made
        assert any(f.is_socket() for f in own.iterdir())  # vLLM's, and the KV events'
        before = {i: w["legs_total"] for i, w in workers(pd_server).items()}
        for i in range(6):
            ours, _ = complete(pd_client, model_dir, prompt_ids(50 + i, 9000 + i), max_tokens=4,
                               temperature=0)
            assert len(ours[0][1]) == 4
        after = workers(pd_server)
        decoders = [i for i, w in after.items() if w["role"] == "decode"]
        assert len(decoders) == 2
        assert all(after[i]["legs_total"] > before.get(i, 0) for i in decoders)

        # A stream in flight on the extra worker finishes intact across its SIGTERM.
        prompt = prompt_ids(80, 9100)
        ref, _ = complete(ref_client, model_dir, prompt, max_tokens=300, temperature=0)
        # Two streams at once: least-loaded routing puts one on each decode worker.
        result, threads = streams_at_once(pd_client, model_dir, prompt, 300)
        wait_for(lambda: workers(pd_server)["decode-0-extra"]["inflight"] > 0, 60,
                 "a stream to reach the extra worker")
        extra.signal(signal.SIGTERM)
        wait_for(lambda: workers(pd_server).get("decode-0-extra", {}).get("state") != "ready",
                 30, "the worker to drain")
        legs = workers(pd_server)["decode-0-extra"]["legs_total"] \
            if "decode-0-extra" in workers(pd_server) else None
        complete(pd_client, model_dir, prompt_ids(20, 9200), max_tokens=2, temperature=0)
        if legs is not None and "decode-0-extra" in workers(pd_server):
            assert workers(pd_server)["decode-0-extra"]["legs_total"] == legs
        for t in threads:
            t.join(120)
        assert result[0] == ref and result[1] == ref
        wait_for(lambda: "decode-0-extra" not in workers(pd_server), 60,
                 "the drained worker to leave the pool")
        extra.proc.wait(60)
        assert extra.proc.returncode == 0
        assert "drained and unregistered" in extra.log()
        assert list(tmp_path.iterdir()) == []
    finally:
        extra.stop()


def test_killed_worker_is_dead_within_expiry_and_requests_go_on(pd_server, pd_client, ref_client,
                                                                model_dir, logs):
    extra = start_worker("decode-0-victim", "decode", pd_server, model_dir, logs)
    try:
        wait_for(lambda: workers(pd_server).get("decode-0-victim", {}).get("state") == "ready",
                 300, "the victim worker", [extra])
        # A long stream on the victim: kill -9 mid-stream; the request migrates and the client
        # still gets exactly the plain engine's tokens.
        prompt = prompt_ids(90, 9300)
        ref, _ = complete(ref_client, model_dir, prompt, max_tokens=400, temperature=0)
        result, threads = streams_at_once(pd_client, model_dir, prompt, 400)
        wait_for(lambda: workers(pd_server)["decode-0-victim"]["inflight"] > 0, 60,
                 "a stream to reach the victim")
        time.sleep(0.3)
        core = engine_core_pid(extra.pid)
        extra.signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: workers(pd_server)["decode-0-victim"]["state"] == "dead", 10,
                 "the controller to mark the worker dead")
        assert time.monotonic() - killed < 6  # 3 missed heartbeats of 1 s, plus a scan
        for t in threads:
            t.join(180)
        assert result[0] == ref and result[1] == ref
        for i in range(3):
            ours, _ = complete(pd_client, model_dir, prompt_ids(30 + i, 9400 + i), max_tokens=3,
                               temperature=0)
            assert len(ours[0][1]) == 3
        metrics = get_text(pd_server.base + "/metrics")
        assert 'pdserve_retries_total{kind="migration"}' in metrics
        # Its engine core, in a process group of its own, follows it: no orphan keeps a core.
        wait_for(lambda: exited(core), 120, "the killed worker's engine core to exit")
    finally:
        extra.stop()


def get_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_worker_on_another_model_is_refused(pd_server, logs, tmp_path):
    from pdserve.models import make_model

    other = make_model(tmp_path / "other-model", "tiny", seed=1)
    w = start_worker("decode-other-model", "decode", pd_server, str(other), logs)
    try:
        w.proc.wait(300)
        assert w.proc.returncode == 3
        assert "refused" in w.log() and "model" in w.log()
        assert "decode-other-model" not in workers(pd_server)
        assert "refused worker decode-other-model" in pd_server.proc.log()
    finally:
        w.stop()


@pytest.fixture(scope="module")
def local_setup(model_dir, logs, keys, reference):
    """A second controller with local prefill for short prompts, and one `both` worker."""
    port, wport = free_port(), free_port()
    ctl = Proc("controller-local", pdserve("controller", "--model", model_dir, "--host",
                                           "127.0.0.1", "--port", str(port), "--worker-port",
                                           str(wport), "--keys", keys,
                                           "--local-prefill-threshold", "64"), logs)
    w = Proc("both-worker", pdserve("worker", "--role", "both", "--worker-id", "both-1",
                                    "--controller", f"tcp://127.0.0.1:{wport}", "--keys", keys,
                                    "--model", model_dir, "--advertise-host", "127.0.0.1",
                                    "--cores", "0"), logs)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: any(x["state"] == "ready" for x in get_json(base + "/pd/workers")),
                 300, "the local-prefill setup", [ctl, w])
        yield base, ctl
    finally:
        w.stop()
        ctl.stop()


def test_short_prompt_is_prefilled_locally(local_setup, ref_client, model_dir):
    import openai

    base, ctl = local_setup
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
    prompt = prompt_ids(20, 9500)
    ours, _ = complete(client, model_dir, prompt, max_tokens=8, temperature=0)
    ref, _ = complete(ref_client, model_dir, prompt, max_tokens=8, temperature=0)
    assert ours == ref
    assert "local (short) decode=both-1" in ctl.log()  # the request's route receipt
    assert "pdserve_local_prefills_total 1.0" in get_text(base + "/metrics")
    [w] = get_json(base + "/pd/workers")
    assert w["legs_total"] == 1  # one leg on one worker: no prefill leg, no handoff


def test_a_worker_with_front_cores_relays_on_them_and_its_engine_keeps_its_core(
        pd_server, pd_client, ref_client, model_dir, logs):
    """--front-cores moves the worker's own process once its engine has started; the engine's
    processes stay on --cores, and the answers it decodes are the plain engine's."""
    extra = start_worker("decode-0-front", "decode", pd_server, model_dir, logs,
                         "--front-cores", "0")
    try:
        wait_for(lambda: workers(pd_server).get("decode-0-front", {}).get("state") == "ready",
                 300, "the worker with --front-cores", [extra])
        assert thread_cpus(extra.pid) == {frozenset({0})}
        engine = tree(engine_core_pid(extra.pid))  # with its model runners, if any
        assert all(thread_cpus(p) == {frozenset({1})} for p in engine)
        assert "this worker's own process is on cores 0" in extra.log()
        # Two streams at once: least-loaded routing puts one on each decode worker.
        prompt = prompt_ids(70, 9500)
        ref, _ = complete(ref_client, model_dir, prompt, max_tokens=60, temperature=0)
        before = workers(pd_server)["decode-0-front"]["legs_total"]
        result, threads = streams_at_once(pd_client, model_dir, prompt, 60)
        for t in threads:
            t.join(120)
        assert result[0] == ref and result[1] == ref
        assert workers(pd_server)["decode-0-front"]["legs_total"] > before
    finally:
        extra.stop()
