"""Failures that reach the client, each with the HTTP status vLLM's server gives it."""

from __future__ import annotations

from http import HTTPStatus

from vllm.exceptions import GracefulHTTPError


class NoWorkerAvailable(GracefulHTTPError):
    """No live worker of a role that the request needs (503: retry later or elsewhere)."""

    def __init__(self, side: str, waited: float):
        super().__init__(f"no {side} worker is available (waited {waited:.0f} s)",
                         HTTPStatus.SERVICE_UNAVAILABLE)
        self.side = side


class StepTimeout(GracefulHTTPError):
    """A step that waits on a worker took longer than its timeout (504)."""

    def __init__(self, step: str, worker_id: str, timeout: float):
        super().__init__(f"{step} on worker {worker_id} timed out after {timeout:.0f} s",
                         HTTPStatus.GATEWAY_TIMEOUT)
        self.step = step
        self.worker_id = worker_id


class RequestFailed(GracefulHTTPError):
    """Workers failed the request more often than the retry budget allows (502)."""

    def __init__(self, message: str):
        super().__init__(message, HTTPStatus.BAD_GATEWAY)
