"""Which controllers a worker serves: found at run time, not fixed when it starts.

Sources, looked at again every `interval` seconds (the worker's heartbeat interval):
- `--controller tcp://HOST:PORT`: HOST is resolved to all of its addresses, one controller per
  address (a Kubernetes headless Service, or any DNS name with several records); an IP address
  is itself.
- `--controllers-file PATH`: one such URL per line (`#` starts a comment), read again whenever
  it is looked at, so an operator or a config map can add and remove controllers.
- Siblings: an accepted controller names the worker ports of the other API servers behind its
  address (`pdserve controller --api-servers N`); they are served too, as long as the link to
  the controller that named them is open.

A lookup that fails keeps what that source gave last time: a DNS outage does not retire
controllers. What the worker does with the set (open links to new controllers, retire the ones
gone) is in worker.py.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

# Resolves a host name to its addresses (the event loop's getaddrinfo by default; tests pass
# their own).
Resolver = Callable[[str], Awaitable[list[str]]]

LOOKUP_TIMEOUT_S = 5.0


class BadControllerURL(ValueError):
    pass


def split_url(url: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` as (host, port)."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise BadControllerURL(f"{url!r}: want tcp://HOST:PORT")
    return parts.hostname, port


def make_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def read_list(text: str) -> list[str]:
    """The URLs in a controllers file; raises BadControllerURL for a line that is not one."""
    urls = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    urls = [u for u in urls if u]
    for u in urls:
        split_url(u)
    return urls


async def resolve_host(host: str) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class Discovery:
    """The set of controller URLs a worker should serve right now."""

    def __init__(self, urls: Iterable[str] = (), files: Iterable[str | Path] = (), *,
                 resolver: Resolver = resolve_host, timeout: float = LOOKUP_TIMEOUT_S):
        self.urls = list(urls)
        self.files = [Path(f) for f in files]
        if not self.urls and not self.files:
            raise ValueError("a worker needs at least one --controller or --controllers-file")
        for u in self.urls:
            split_url(u)  # a typo fails at start, not at the first lookup
        self.resolver = resolver
        self.timeout = timeout
        self._last: dict[str, set[str]] = {}  # source -> what it gave when it last worked
        self._failing: set[str] = set()  # sources whose last lookup failed (logged once)

    def static(self) -> set[str] | None:
        """The set without lookups, when every source is a literal address (else None)."""
        if self.files or not all(is_address(split_url(u)[0]) for u in self.urls):
            return None
        return set(self.urls)

    async def find(self) -> set[str]:
        """Every controller URL the sources name now (siblings are added by the worker)."""
        sources: list[tuple[str, Awaitable[set[str]]]] = [(u, self._expand(u)) for u in self.urls]
        sources += [(str(f), self._read(f)) for f in self.files]
        found: set[str] = set()
        for name, lookup in sources:
            try:
                async with asyncio.timeout(self.timeout):
                    got = await lookup
            except (OSError, TimeoutError, BadControllerURL, UnicodeDecodeError) as e:
                if name not in self._failing:
                    self._failing.add(name)
                    logger.warning("controller lookup %s failed (%s: %s); keeping the %d "
                                   "controller(s) it gave before", name, type(e).__name__, e,
                                   len(self._last.get(name, ())))
                got = self._last.get(name, set())
            else:
                if name in self._failing:
                    self._failing.discard(name)
                    logger.info("controller lookup %s works again", name)
                self._last[name] = got
            found |= got
        return found

    async def _expand(self, url: str) -> set[str]:
        host, port = split_url(url)
        if is_address(host):
            return {url}
        return {make_url(a, port) for a in await self.resolver(host)}

    async def _read(self, path: Path) -> set[str]:
        found: set[str] = set()
        for url in read_list(path.read_text()):
            found |= await self._expand(url)
        return found


def siblings(url: str, ports: Iterable[int]) -> set[str]:
    """The URLs of the API servers a controller at `url` names by their worker ports."""
    host, _ = split_url(url)
    return {make_url(host, p) for p in ports}
