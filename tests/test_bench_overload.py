"""`pdserve bench overload`: its response classification, and a brief run against a real
controller with fake workers in their own processes. Behaviour only, no wall-clock figures."""

from __future__ import annotations

import json
import os

import pytest

from pdserve.bench import overload

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def sse(*events: dict) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_responses_are_classified():
    def c(status, text, headers=None, latency=0.1):
        return overload.classify("p", status, latency, headers or {}, text, timeout=60.0)

    refused = c(429, json.dumps({"error": {"message": "at capacity", "code": 429}}),
                {"retry-after": "2"})
    assert (refused.outcome, refused.retry_after) == ("refused", "2")
    timeout = c(503, json.dumps({"error": {"message": "no slot ... queue timeout (10 s)"}}))
    assert timeout.outcome == "queue_timeout" and timeout.retry_after is None
    assert c(503, json.dumps({"error": {"message": "no decode worker"}})).outcome == "failed"
    assert c(500, "oops").outcome == "failed"
    done = sse({"choices": [{"finish_reason": None}]}, {"choices": [{"finish_reason": "length"}]})
    assert c(200, done).outcome == "served"
    assert c(200, done, latency=61.0).outcome == "failed"  # slower than the client's timeout
    assert c(200, done[:-len("data: [DONE]\n\n")]).outcome == "failed"
    in_stream = c(200, sse({"error": {"message": "at capacity", "code": 429}}))
    assert in_stream.outcome == "refused" and in_stream.in_stream
    rows = overload.summarize([refused, timeout, in_stream, c(200, done)], "p", 1.0)
    assert rows["refusals_without_retry_after"] == 1  # the 503 above had none
    assert (rows["served"], rows["refused"], rows["queue_timeout"]) == (1, 2, 1)
    assert rows["in_stream_errors"] == 1


# The controller's own cap, or (as over real engines, with the cap far above) the decode
# engine's slots, or, with no decode worker, the slots of the prefill engine that serves requests
# whole: 10x of 4 at once for 5 s is ~200 requests, none refused if the slots were not counted.
SLOTS = ["--max-seqs", "4", "--max-inflight", "512"]


@pytest.mark.parametrize("limit", [[], SLOTS, [*SLOTS, "--without", "decode"]],
                         ids=["max-inflight", "decode-slots", "prefill-slots-in-fallback"])
def test_a_brief_overload_is_refused_with_429_and_the_pool_serves_afterwards(tmp_path, limit):
    args = overload.make_parser().parse_args(["--duration", "5", "--after-duration", "3",
                                              *limit])
    res = overload.run(args, tmp_path)
    over, after = res["rows"]
    assert over["served"] > 0 and over["refused"] > 0, over
    assert over["failed"] == 0, over  # any 5xx but the admission 503 would be counted here
    assert set(over["statuses"]) <= {"200", "429", "503"}, over
    assert over["refusals_without_retry_after"] == 0, over
    assert res["drained_before_after_phase"]
    assert after["offered"] > 0 and after["served"] == after["offered"], after
    rss = res["rss_mib"]
    assert rss["peak_during_overload"] < 1.5 * rss["start"], rss
    assert rss["after"] < 1.5 * rss["start"], rss
