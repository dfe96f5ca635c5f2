"""`pdserve bench soak`: its event schedule, response accounting and /proc sampling. No engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pdserve import procfs
from pdserve.bench import soak


def sse(*events: dict, done: bool = True) -> str:
    return "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events) + (
        "data: [DONE]\n\n" * done)


def req(max_tokens: int = 4, api: str = "completions", stream: bool = True,
        greedy: int | None = None) -> soak.Req:
    return soak.Req(soak.Case(api, [5, 6, 7], max_tokens), stream, greedy)


def test_schedule_is_one_event_per_cycle_in_turn():
    assert soak.schedule(240, 60) == [(30, "join"), (90, "drain"), (150, "join"), (210, "kill")]
    plan = soak.schedule(1200, 180)
    assert [e for _, e in plan] == ["join", "drain", "join", "kill", "join", "drain", "join"]
    assert all(t < 1200 for t, _ in plan)
    assert soak.schedule(100, 0) == [] and soak.schedule(0, 60) == []
    assert len(soak.schedule(1e9, 1)) == 10_000  # bounded


def test_payloads_sample_by_default_and_greedy_only_for_reference_cases():
    chat = soak.Req(soak.Case("chat", "hello there", 8), True).payload("m")
    assert "temperature" not in chat and "seed" not in chat
    assert chat["messages"] == [{"role": "user", "content": "hello there"}]
    assert chat["stream_options"] == {"include_usage": True}
    greedy = req(greedy=3, stream=False).payload("m")
    assert greedy["temperature"] == 0 and greedy["prompt"] == [5, 6, 7]
    assert "stream" not in greedy and greedy["return_token_ids"]


def test_streams_and_whole_responses_are_parsed():
    body = sse({"choices": [{"text": "a", "token_ids": [1], "finish_reason": None}]},
               {"choices": [{"text": "b", "token_ids": [2], "finish_reason": "length"}]},
               {"choices": [], "usage": {"completion_tokens": 2}})
    assert soak.parse_answer("completions", True, body) == soak.Answer("ab", "length", 2, (1, 2))
    chat = sse({"choices": [{"delta": {"role": "assistant"}}]},
               {"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}]},
               {"choices": [], "usage": {"completion_tokens": 1}}, done=False)
    assert soak.parse_answer("chat", True, chat) == soak.Answer("hi", "stop", 1, None, False)
    whole = {"choices": [{"message": {"content": "yo"}, "finish_reason": "stop"}],
             "usage": {"completion_tokens": 1}}
    assert soak.parse_answer("chat", False, json.dumps(whole)) == soak.Answer("yo", "stop", 1)
    # JSON leaves these unescaped; a random model's text holds them now and then.
    odd = "a\u2028b\x85c\u2029d"
    body = sse({"choices": [{"text": odd, "finish_reason": "length"}]},
               {"choices": [], "usage": {"completion_tokens": 1}})
    assert odd in body and soak.parse_answer("completions", True, body).text == odd
    with pytest.raises(soak.StreamError, match="worker lost"):
        soak.parse_answer("completions", True, sse({"error": {"message": "worker lost"}}))


def test_answers_are_judged_whole_short_or_wrong():
    ok = soak.Answer("abcd", "length", 4, (1, 2, 3, 4))
    assert soak.judge(req(), ok, None) == ("whole", "")
    assert soak.judge(req(), soak.Answer("ab", "stop", 2), None)[0] == "whole"  # EOS sampled
    for cut in (soak.Answer("ab", None, 2), soak.Answer("ab", "length", 2),
                soak.Answer("abcd", "length", 4, (1, 2, 3)), soak.Answer("abcd", "abort", 4),
                soak.Answer("abcd", "length", None), soak.Answer("abcd", "length", 4, None, False)):
        assert soak.judge(req(), cut, None)[0] == "short", cut
    assert soak.judge(req(greedy=0), ok, ok) == ("whole", "")
    verdict, detail = soak.judge(req(greedy=0), soak.Answer("abXd", "length", 4, (1, 2, 9, 4)),
                                 ok)
    assert verdict == "wrong" and "from char 2" in detail
    # Chat has no token ids: the text decides.
    assert soak.judge(req(api="chat", greedy=1), soak.Answer("abcd", "length", 4),
                      soak.Answer("abce", "length", 4))[0] == "wrong"


def test_tally_counts_each_request_once_and_failures_by_kind():
    t = soak.Tally()
    t.add("whole", latency=0.5)
    t.add("whole", greedy=True, latency=1.5)
    t.add("wrong", detail="case 1", greedy=True, latency=1.0)
    t.add("failed", "HTTP 503", "no decode worker")
    t.add("failed", "HTTP 503", "no decode worker")
    t.add("failed", "ServerDisconnectedError", "")
    t.add("lost", detail="no answer within 120 s")
    s = t.summary()
    assert (s["offered"], s["whole"], s["wrong"], s["short"], s["failed"], s["lost"]) == \
        (7, 2, 1, 0, 3, 1)
    assert s["failed_by_kind"] == {"HTTP 503": 2, "ServerDisconnectedError": 1}
    assert s["greedy_checked"] == 2
    assert s["examples"]["failed: HTTP 503"] == ["no decode worker"] * 2
    assert s["latency_ms"]["p50"] == 1000.0
    with pytest.raises(AssertionError):
        t.add("maybe")


def test_controller_counters_are_reported_as_increases():
    before = {"pdserve_requests_total{outcome=completed}": 10.0,
              "pdserve_retries_total{kind=migration}": 1.0, "pdserve_inflight_sequences": 3.0}
    after = {"pdserve_requests_total{outcome=completed}": 25.0,
             "pdserve_retries_total{kind=migration}": 1.0,
             "pdserve_retries_total{kind=prefill_retry}": 2.0, "pdserve_inflight_sequences": 0.0}
    assert soak.increase(before, after) == {"pdserve_requests_total{outcome=completed}": 15.0,
                                            "pdserve_retries_total{kind=prefill_retry}": 2.0}


def test_own_process_is_sampled_from_proc():
    rss, fds = soak.usage(os.getpid())
    assert rss > 1000 and fds >= 3
    r, w = os.pipe()
    try:
        assert soak.usage(os.getpid())[1] == fds + 2
    finally:
        os.close(r)
        os.close(w)
    assert soak.usage(2**22 + 7) is None  # beyond pid_max: never a process
    assert procfs.alive(os.getpid()) and not procfs.alive(2**22 + 7)


def test_children_are_found_through_parentage_and_named():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             start_new_session=True)  # its own group, as an engine is
    try:
        for _ in range(100):  # its command line appears a moment after exec
            if soak.name_of(child.pid) != "?":
                break
            time.sleep(0.01)
        assert child.pid in procfs.tree(os.getpid())
        names = soak.pool_processes([os.getpid()])
        assert names[os.getpid()].startswith(("python", "pytest"))
        assert names[child.pid] == f"{names[os.getpid()]}/{os.path.basename(sys.executable)}"
        s = soak.sample([os.getpid()], 12.34)
        assert s["t"] == 12.3 and str(child.pid) in s["procs"]
    finally:
        child.kill()
        child.wait()
    assert child.pid not in procfs.tree(os.getpid())


def test_pdserve_commands_are_named_by_role(tmp_path):
    def proc(pid: int, *args: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes("\0".join(args).encode() + b"\0")

    py = "/venv/bin/python"
    proc(1, py, "-m", "pdserve.cli", "serve", "--model", "m")
    proc(2, py, "-m", "pdserve.cli", "worker", "--role", "decode", "--worker-id", "decode-soak-1")
    proc(3, py, "-m", "pdserve.cli", "worker", "--role", "prefill")
    proc(4, "VLLM::EngineCore")
    proc(5, py, "-B", "-c", "from multiprocessing.resource_tracker import main;main(25)")
    assert [soak.name_of(p, tmp_path) for p in range(1, 7)] == [
        "serve", "worker decode decode-soak-1", "worker prefill", "VLLM::EngineCore",
        "resource_tracker", "?"]


def test_shared_memory_left_behind_is_ours_and_used_by_no_process(tmp_path):
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    for name, size in (("others", 1), ("in_use", 2), ("held_open", 3), ("psm_left", 2**21)):
        (shm / name).write_bytes(b"x" * size)
    (proc / "7" / "fd").mkdir(parents=True)
    (proc / "7" / "maps").write_text(
        f"7f00-7f10 rw-s 00000000 00:1a 42                         {shm}/in_use\n"
        "7f10-7f20 r-xp 00000000 00:00 0 \n")
    (proc / "7" / "fd" / "3").symlink_to(shm / "held_open")
    (proc / "8" / "fd").mkdir(parents=True)
    (proc / "8" / "maps").write_text(f"7f00-7f10 rw-s 00000000 00:1a 43 {shm}/psm_left (deleted)\n")
    # A named semaphore, mapped under the temporary name glibc made it as: known by its inode.
    (shm / "sem.mp-abc").write_bytes(b"x" * 32)
    st = (shm / "sem.mp-abc").stat()
    (proc / "9" / "fd").mkdir(parents=True)
    (proc / "9" / "maps").write_text(
        f"7f00-7f10 rw-s 00000000 {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} "
        f"{st.st_ino}                    {shm}/sem.Xy12Ab (deleted)\n")
    assert procfs.shm_used([9], shm, proc) == {"sem.mp-abc"}
    (shm / "sem.mp-abc").unlink()
    (proc / "9" / "maps").write_text("")
    (proc / "self").mkdir()  # not a pid: skipped
    assert set(procfs.shm_segments(shm)) == {"others", "in_use", "held_open", "psm_left"}
    assert procfs.shm_used([7], shm, proc) == {"in_use", "held_open"}
    assert procfs.shm_used([8, 99], shm, proc) == {"psm_left"}  # 99: gone
    assert procfs.shm_used(None, shm, proc) == {"in_use", "held_open", "psm_left"}
    (proc / "8" / "maps").write_text("")  # the engine that used it died
    ours = {"in_use", "psm_left", "gone_already"}  # "others": never seen used by the pool
    left = soak.shm_left(ours, (shm / "psm_left").stat().st_mtime - 5, shm, proc)
    assert left == {"psm_left": {"mib": 2.0, "t": 5.0}}
    assert procfs.shm_segments(tmp_path / "none") == {}


def test_process_rows_keep_first_and_last_sample():
    samples = [{"t": 0.0, "procs": {"10": ["controller", 102400, 40],
                                    "11": ["worker decode", 512000, 60]}},
               {"t": 60.0, "procs": {"10": ["controller", 110592, 41],
                                     "12": ["worker decode decode-soak-1", 400000, 50]}},
               {"t": 120.0, "procs": {"10": ["controller", 104448, 40]}}]
    rows = {r["pid"]: r for r in soak.process_rows(samples)}
    assert rows[10] == {"process": "controller", "pid": 10, "first_t": 0.0, "last_t": 120.0,
                        "rss_start_mib": 100.0, "rss_end_mib": 102.0, "rss_max_mib": 108.0,
                        "fds_start": 40, "fds_end": 40}
    assert (rows[11]["first_t"], rows[11]["last_t"]) == (0.0, 0.0)
    assert rows[12]["process"] == "worker decode decode-soak-1"
    assert list(rows) == [10, 11, 12]


def test_markdown_reports_partial_results():
    res = {"command": "pdserve bench soak --duration 10", "model": "m", "events": [],
           "samples": [], "processes": [], "args": vars(soak.make_parser().parse_args([]))}
    assert "# pdserve bench soak" in soak.markdown(res)
    t = soak.Tally()
    t.add("whole", latency=0.2)
    res |= {"tally": t.summary(), "duration_s": 10.0, "rate_req_s": 1.0, "capacity": None,
            "events": [{"t": 5.0, "event": "join", "worker": "decode-soak-1",
                        "result": "ready after 40 s"}]}
    text = soak.markdown(res)
    assert "completed whole 1, wrong 0, short 0, failed 0, lost 0" in text
    assert "| 5 | join | decode-soak-1 |  | ready after 40 s |" in text


def test_bad_ranges_are_refused():
    assert soak.span("16-128") == (16, 128) and soak.span("7") == (7, 7)
    for bad in ("0-4", "9-3", "x"):
        with pytest.raises(ValueError):
            soak.span(bad)
    assert soak.main(["--prompt-len", "9-3"]) == 2
