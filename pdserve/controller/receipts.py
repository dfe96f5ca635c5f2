"""Route receipts: why a request went where it went, for its response and its log line.

A sequence fills one `Route` as it is placed: local or disaggregated, the prefill and decode
workers and how many of the prompt's tokens the pool's KV index said each engine held
("cached"; "?" where it could not say), and, once the decode engine reports it, the tokens its
own cache really had and the KV bytes read from the prefill worker. The HTTP middleware
(server.py) opens a receipt per request (a context variable that the request's handler and its
streaming task both see) and sends it as the `x-pdserve-route` header with the first body
bytes: by then every sequence of the request has been placed.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass
class Route:
    tokens: int = 0  # the context placed (prompt, plus tokens already streamed on a retry)
    path: str = ""  # "local" (one worker prefills and decodes) or "disaggregated"
    reason: str = ""  # why local: "short" prompt, or "cached" (little left to compute there)
    prefill: str = ""
    prefill_cached: int | None = None  # the index's word, at placement
    prefill_hit: int | None = None  # what the prefill engine had (its report)
    decode: str = ""
    decode_cached: int | None = None
    decode_hit: int | None = None  # what the decode engine had itself (its report)
    kv_read_tokens: int | None = None  # tokens whose KV it read from the prefill worker
    kv_bytes: int | None = None
    kv_read_in_step: bool | None = None  # the read was inside the step computing the next token

    def placed(self, tokens: int, decode: str, decode_cached: int | None) -> None:
        """A new attempt starts with its decode worker chosen: forget the last one's."""
        self.__init__(tokens=tokens, decode=decode,  # type: ignore[misc]
                      decode_cached=decode_cached)

    def describe(self) -> str:
        parts = [self.path + (f" ({self.reason})" if self.reason else "")]
        if self.prefill:
            parts.append(f"prefill={self.prefill} cached={_n(self.prefill_cached)}")
        parts.append(f"decode={self.decode} cached={_n(self.decode_cached)}")
        if self.kv_bytes is not None:
            parts.append(f"kv_bytes={self.kv_bytes}")
        return " ".join(parts)


def _n(v: int | None) -> str:
    return "?" if v is None else str(v)


_current: contextvars.ContextVar[list[Route] | None] = contextvars.ContextVar(
    "pdserve_routes", default=None)


def open_receipt() -> list[Route]:
    """The routes of the request being served in this context (filled as they are placed)."""
    routes: list[Route] = []
    _current.set(routes)
    return routes


def new_route() -> Route:
    """A route for one sequence, on the current request's receipt if there is one."""
    route = Route()
    routes = _current.get()
    if routes is not None and len(routes) < 64:  # n is bounded; so is the header
        routes.append(route)
    return route


def header(routes: list[Route]) -> str:
    return ", ".join(r.describe() for r in routes if r.path)
