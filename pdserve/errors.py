"""Failures that reach the client, each with the HTTP status vLLM's server gives it."""

from __future__ import annotations

import re
from http import HTTPStatus

from vllm.exceptions import GracefulHTTPError

from pdserve.protocol import Role


class PdserveError(GracefulHTTPError):
    """A failure pdserve raises on purpose: its message says what happened."""


class NoWorkerAvailable(PdserveError):
    """No live worker of a role that the request needs (503: retry later or elsewhere)."""

    def __init__(self, side: Role, waited: float):
        super().__init__(f"no {side.label} worker is available (waited {waited:.0f} s)",
                         HTTPStatus.SERVICE_UNAVAILABLE)
        self.side = side


class StepTimeout(PdserveError):
    """A step that waits on a worker took longer than its timeout (504)."""

    def __init__(self, step: str, worker_id: str, timeout: float):
        super().__init__(f"{step} on worker {worker_id} timed out after {timeout:.0f} s",
                         HTTPStatus.GATEWAY_TIMEOUT)
        self.step = step
        self.worker_id = worker_id


class RequestFailed(PdserveError):
    """Workers failed the request more often than the retry budget allows (502)."""

    def __init__(self, message: str):
        super().__init__(message, HTTPStatus.BAD_GATEWAY)


class Refused(PdserveError):
    """Admission control turned the request away; `retry_after` (s) goes out as Retry-After."""

    def __init__(self, message: str, status: HTTPStatus, reason: str, retry_after: int):
        super().__init__(f"{message}; retry after {retry_after} s", status)
        self.reason = reason
        self.retry_after = retry_after


_RETRY_AFTER = re.compile(r"; retry after (\d+) s$")


def retry_after_in(message: str) -> int | None:
    """The seconds a Refused's message names: a refusal that came inside a stream reaches the
    HTTP layer as vLLM's error body, its text alone."""
    m = _RETRY_AFTER.search(message)
    return int(m.group(1)) if m else None


class Overloaded(Refused):
    """The admission line is full, or would not clear in time (429)."""

    def __init__(self, message: str, reason: str, retry_after: int):
        super().__init__(message, HTTPStatus.TOO_MANY_REQUESTS, reason, retry_after)


class QueueTimeout(Refused):
    """A request waited the queue timeout for an admission slot (503)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE, "queue_timeout", retry_after)


# A worker registers within a heartbeat of its engine being ready, and an engine starts in tens
# of seconds: a client told to come back in a few seconds neither hammers nor waits long.
NO_WORKER_RETRY_AFTER_S = 5


class NoWorkerReady(Refused):
    """No worker of a role the request needs is ready (503): the pool is starting, or its last
    worker of that role left."""

    def __init__(self, side: Role):
        super().__init__(f"no {side.label} worker is available", HTTPStatus.SERVICE_UNAVAILABLE,
                         "no_worker", NO_WORKER_RETRY_AFTER_S)
        self.side = side


class ShuttingDown(Refused):
    """The controller is stopping (503): another replica, or this one restarted, will serve."""

    def __init__(self) -> None:
        super().__init__("this controller is shutting down", HTTPStatus.SERVICE_UNAVAILABLE,
                         "shutting_down", 1)


class TooManySequences(PdserveError):
    """A request asks for more sequences (n) than the controller ever runs at once (400)."""

    def __init__(self, n: int, max_inflight: int):
        super().__init__(f"the request asks for {n} sequences; this controller runs at most "
                         f"{max_inflight} at once (--max-inflight)", HTTPStatus.BAD_REQUEST)
