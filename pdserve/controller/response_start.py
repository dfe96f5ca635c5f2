"""The start of every HTTP response, held back until its first body bytes (server.py installs
this middleware in front of vLLM's server).

By then the request's sequences are placed, so the start carries pdserve's headers: the
controller that answered (`x-pdserve-controller`: with several API servers or replicas behind
one address, the one whose logs and /pd views tell the story) and the route receipt
(`x-pdserve-route`, receipts.py).

And a streamed response whose first event is an error failed before any output: a queue
timeout, no worker of a role, every attempt failed. vLLM's server has started that stream
before pdserve's generator ran, so it would send a 200 and then the error as an event, which
clients count as a failure they cannot retry. Here it goes out instead as a whole response
with the error's own status and vLLM's JSON error body, as a request without streaming gets
it, with Retry-After where the refusal names one. A failure after the first output stays an
event in the stream: its 200 and tokens are gone by then. Plain ASGI otherwise: streamed
bodies pass through untouched.

vLLM's stream generators log such a failure with its traceback; `OneLine` keeps pdserve's own
failures (errors.py) to one line.
"""

from __future__ import annotations

import json
import logging

from pdserve.controller.receipts import header as receipt_header
from pdserve.controller.receipts import open_receipt
from pdserve.errors import PdserveError, Refused, retry_after_in

SSE = b"text/event-stream"
ERROR_EVENT = b'data: {"error"'  # vLLM's streamed error: `data: {"error": {..., "code": 503}}`


def error_before_output(start: dict, body: bytes) -> tuple[int, bytes, str] | None:
    """(status, JSON body, error message) when `body`, the first bytes of the response that
    `start` begins, is an event stream's error event; else None."""
    if not body.startswith(ERROR_EVENT) or not _header(start, b"content-type").startswith(SSE):
        return None
    event = body.split(b"\n\n", 1)[0][len(b"data: "):]
    try:
        error = json.loads(event)["error"]
        status = int(error["code"])
    except (ValueError, KeyError, TypeError):
        return None
    if not 400 <= status <= 599:
        return None
    return status, event, str(error.get("message", ""))


def _header(message: dict, name: bytes) -> bytes:
    return next((v for k, v in message.get("headers", ()) if k.lower() == name), b"")


class ResponseStart:
    def __init__(self, app, controller_id: str):
        self.app = app
        self.controller = (b"x-pdserve-controller", controller_id.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        routes = open_receipt()
        start: dict | None = None
        replaced = False  # an error response went out in the stream's place: drop the rest

        def ours() -> list[tuple[bytes, bytes]]:
            headers = [self.controller]
            if receipt := receipt_header(routes):
                headers.append((b"x-pdserve-route", receipt.encode()))
            return headers

        async def send_held(message):
            nonlocal start, replaced
            if replaced:
                return
            if message["type"] == "http.response.start":
                start = message  # sent with the first body bytes
                return
            if start is not None:
                held, start = start, None
                error = error_before_output(held, message.get("body", b""))
                if error is not None:
                    replaced = True
                    await _send_error(send, *error, ours())
                    return
                await send({**held, "headers": [*held.get("headers", ()), *ours()]})
            await send(message)

        await self.app(scope, receive, send_held)


async def _send_error(send, status: int, body: bytes, message: str,
                      headers: list[tuple[bytes, bytes]]) -> None:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *headers]
    if (seconds := retry_after_in(message)) is not None:
        headers.append((b"retry-after", str(seconds).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# vLLM's stream generators log whatever ends a stream early, with its traceback.
STREAM_LOGGERS = ("vllm.entrypoints.openai.completion.serving",
                  "vllm.entrypoints.openai.chat_completion.serving")


class OneLine(logging.Filter):
    """pdserve's own failures (errors.py) say what happened in their message: logged in one
    line, not a traceback, and a refusal (expected under load, counted in
    pdserve_admission_rejections_total) as a warning, not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, PdserveError):
            record.msg, record.args = f"{record.getMessage()} {type(exc).__name__}: {exc}", ()
            record.exc_info, record.exc_text = None, None
            if isinstance(exc, Refused):
                record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def log_failures_in_one_line() -> None:
    for logger in map(logging.getLogger, STREAM_LOGGERS):
        if not any(isinstance(f, OneLine) for f in logger.filters):
            logger.addFilter(OneLine())
