"""A leg's inbox: asyncio.Queue's interface for one reader, with less work per item.

Every output of every stream passes through one (pool.py puts, sequence.py reads). A queue
with one reader and no bound needs no list of waiting getters and putters, no task
accounting and no size check: a deque, and the one reader's future while it waits.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class Mailbox:
    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # done: its reader was cancelled
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Any:
        """The oldest item; IndexError when there is none."""
        return self._items.popleft()

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()
