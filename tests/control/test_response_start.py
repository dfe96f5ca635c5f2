"""The response start middleware (controller/response_start.py) on a bare ASGI app: pdserve's
headers go out with the first body bytes, and a stream that fails before its first output is
answered with the error's own status instead of a 200 with an error event."""

from __future__ import annotations

import json
import logging
import sys

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from pdserve.controller.response_start import (STREAM_LOGGERS, OneLine, ResponseStart,
                                               error_before_output)
from pdserve.errors import QueueTimeout, RequestFailed, retry_after_in

SSE_START = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]}


def event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def error(code: int, message: str) -> dict:
    return {"error": {"message": message, "type": "x", "param": None, "code": code}}


def test_an_error_event_first_in_a_stream_is_the_errors_status_and_body():
    status, body, message = error_before_output(SSE_START, event(error(503, "no slot")))
    assert (status, json.loads(body), message) == (503, error(503, "no slot"), "no slot")


def test_output_first_or_a_body_that_is_not_a_stream_passes():
    assert error_before_output(SSE_START, event({"id": "cmpl-1", "choices": []})) is None
    assert error_before_output(SSE_START, b"data: [DONE]\n\n") is None
    json_start = {**SSE_START, "headers": [(b"content-type", b"application/json")]}
    assert error_before_output(json_start, event(error(503, "x"))) is None
    assert error_before_output(SSE_START, b'data: {"error": not json}\n\n') is None
    assert error_before_output(SSE_START, event(error(200, "not an error status"))) is None


def test_the_retry_after_a_refusal_names_is_read_back_from_its_message():
    assert retry_after_in(QueueTimeout("no slot came free", 7).message) == 7
    assert retry_after_in("the prefill worker failed") is None


def client_for(*chunks: bytes) -> httpx.AsyncClient:
    async def stream(request):
        async def body():
            for chunk in chunks:
                yield chunk
        return StreamingResponse(body(), media_type="text/event-stream")

    async def whole(request):
        return JSONResponse(error(400, "bad"), status_code=400)

    app = ResponseStart(Starlette(routes=[Route("/s", stream), Route("/w", whole)]), "ctl-1")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_a_stream_that_fails_before_its_first_output_is_a_503_with_retry_after():
    refusal = QueueTimeout("no slot came free within the queue timeout (60 s)", 4)
    async with client_for(event(error(503, refusal.message)), b"data: [DONE]\n\n") as client:
        r = await client.get("/s")
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/json"
    assert r.headers["retry-after"] == "4"
    assert r.headers["x-pdserve-controller"] == "ctl-1"
    assert r.json() == error(503, refusal.message)  # the [DONE] after it is dropped


async def test_a_stream_that_fails_after_output_keeps_its_200_and_the_error_event():
    chunks = (event({"id": "cmpl-1", "choices": [{"text": "a"}]}),
              event(error(502, "the decode worker failed")), b"data: [DONE]\n\n")
    async with client_for(*chunks) as client:
        r = await client.get("/s")
        whole = await client.get("/w")
    assert r.status_code == 200 and r.content == b"".join(chunks)
    assert r.headers["x-pdserve-controller"] == "ctl-1"
    assert "retry-after" not in r.headers
    # A response that is not a stream keeps its own status and body, with the header added.
    assert whole.status_code == 400 and whole.json() == error(400, "bad")
    assert whole.headers["x-pdserve-controller"] == "ctl-1"


def logged(exc: BaseException) -> logging.LogRecord:
    """What vLLM's stream generator logs when `exc` ends a stream, through the filter."""
    try:
        raise exc
    except BaseException:
        record = logging.LogRecord(STREAM_LOGGERS[0], logging.ERROR, __file__, 1,
                                   "Error in completion stream generator.", (), sys.exc_info())
    assert OneLine().filter(record)
    return record


def test_pdserves_own_failures_are_logged_in_one_line_and_a_refusal_as_a_warning():
    refusal = logged(QueueTimeout("no slot came free", 3))
    assert refusal.exc_info is None and refusal.levelno == logging.WARNING
    assert refusal.getMessage() == ("Error in completion stream generator. QueueTimeout: no slot "
                                    "came free; retry after 3 s")
    failed = logged(RequestFailed("the decode worker failed 3 times"))
    assert failed.exc_info is None and failed.levelno == logging.ERROR
    assert "RequestFailed: the decode worker failed 3 times" in failed.getMessage()
    bug = logged(KeyError("a bug"))  # anything else keeps its traceback
    assert bug.exc_info is not None and bug.levelno == logging.ERROR


def test_the_filtered_loggers_are_those_of_vllms_stream_generators():
    from vllm.entrypoints.openai.chat_completion import serving as chat
    from vllm.entrypoints.openai.completion import serving as completion

    assert {completion.logger.name, chat.logger.name} == set(STREAM_LOGGERS)
