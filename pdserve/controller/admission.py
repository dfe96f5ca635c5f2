"""Admission: at most `max_inflight` sequences run at once, at most `max_queued` wait for a slot.

Nor more than the decode workers can run: every sequence ends as a stream on a decode engine,
which runs at most its --max-num-seqs requests and queues the rest. A sequence let through
beyond that had its prompt prefilled and its first token streamed, then waited inside the
decode engine for a running stream to end: seconds of silence after a fast first token, with
its prompt's blocks held on the prefill engine meanwhile. So the limit is the smaller of
max_inflight and the decode slots free for this controller (`slots`: over the ready decode
workers, their max_seqs less what other controllers hold there, as of their last heartbeats;
None when unknown), and the rest waits here, in line, before any prefill. While no decode
worker is left and the prefill workers serve requests whole (the fallback), their slots count
instead, for the same reason.

A request's path: `check` (before vLLM's server starts a response) -> `acquire`: its slots at
once, or WAITING in line (FIFO) until they are free -> HOLDING -> `release`. It is refused
instead, with `Overloaded` (429), when the line is full or would not clear within half the
queue timeout; a waiter gives up with `QueueTimeout` (503) after the queue timeout, and a
cancelled waiter leaves the line. A request with n > 1 takes n slots, as vLLM's
check_admission counts it. So overload is turned away at the door, and the controller holds at
most max_inflight + max_queued (+ the grace below) sequences whatever the offered load.

Pure bookkeeping, apart from the wait itself (an asyncio.Event per waiter); the clock measures
how long requests hold their slots, for the expected wait and the Retry-After value.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.errors import Overloaded, QueueTimeout, TooManySequences

HOLD_WEIGHT = 0.1  # moving average of hold times: reacts within a few dozen requests
# The line is kept to what should clear in this share of the queue timeout: the wait is an
# estimate from average hold times, and a request refused at once (429 with Retry-After) costs
# its client less than one that waits the whole timeout and then gets a 503.
WAIT_SHARE = 0.5


def limits(max_inflight: int, max_queued: int, max_total: int | None = None) -> tuple[int, int]:
    """`--max-inflight` and `--max-queued`, within vLLM's `--max-num-queued-reqs` if it is set
    (vLLM's cap on running + waiting requests, honoured here as the same cap)."""
    if max_inflight < 1 or max_queued < 0:
        raise ValueError(f"--max-inflight must be at least 1 and --max-queued at least 0 "
                         f"(got {max_inflight}, {max_queued})")
    if max_total is None:
        return max_inflight, max_queued
    if max_total < 1:
        raise ValueError(f"--max-num-queued-reqs {max_total} would refuse every request")
    inflight = min(max_inflight, max_total)
    return inflight, min(max_queued, max_total - inflight)


class Slots(NamedTuple):
    """The ready decode workers' slots: free for this controller, and all of them."""

    free: int
    total: int


@dataclass(eq=False)
class Ticket:
    """One request's claim on n slots."""

    n: int
    granted_at: float | None = None  # None while waiting in line
    released: bool = False
    granted: asyncio.Event = field(default_factory=asyncio.Event)


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, timeout: float,
                 clock: Callable[[], float] = time.monotonic,
                 slots: Callable[[], Slots | None] = lambda: None):
        self.max_inflight, self.max_queued = limits(max_inflight, max_queued)
        self.timeout = timeout
        self.clock = clock
        self.slots = slots
        # A request that passed `check` while the line had room may find it full when it
        # reaches `enter` (vLLM renders the prompt in between): it may still wait, this many
        # slots beyond max_queued, rather than be refused after the door let it in.
        self.grace = max(8, self.max_queued // 8)
        self.inflight = 0  # slots held
        self.queued = 0  # slots waited for
        self._line: deque[Ticket] = deque()
        self._hold: float | None = None  # average seconds a request holds its slots

    def check(self, n: int = 1) -> None:
        """Refuse a request that could neither start now nor wait its turn in time."""
        self._check_size(n)
        if self._fits(n):
            return
        if self.queued + n > self.max_queued:
            raise Overloaded(f"the controller is at capacity: {self.inflight} sequences running "
                             f"({self._limit_said()}), {self.queued} waiting (--max-queued "
                             f"{self.max_queued})", "queue_full", self.retry_after())
        wait = self.expected_wait(n)
        if wait > WAIT_SHARE * self.timeout:
            raise Overloaded(f"the controller is at capacity: the line would take ~{wait:.0f} s "
                             f"to clear, over half the queue timeout ({self.timeout:g} s)",
                             "expected_wait", self.retry_after())

    def enter(self, n: int = 1) -> Ticket:
        """Claim n slots: granted at once if they are free and nobody waits, else in line."""
        self._check_size(n)
        t = Ticket(n)
        if self._fits(n):
            self._start(t)
        elif self.queued + n > self.max_queued + self.grace:
            raise Overloaded(f"the controller is at capacity: {self.inflight} sequences running, "
                             f"{self.queued} waiting", "queue_full", self.retry_after())
        else:
            self._line.append(t)
            self.queued += n
        return t

    async def acquire(self, n: int = 1) -> Ticket:
        """A ticket holding n slots, after waiting in line if need be; `release` it when done."""
        t = self.enter(n)
        if t.granted_at is not None:
            return t
        try:
            async with asyncio.timeout(self.timeout):
                await t.granted.wait()
        except TimeoutError:
            if t.granted_at is None:  # else the slots came in the same instant: keep them
                self.release(t)
                raise QueueTimeout(f"no slot came free within the queue timeout "
                                   f"({self.timeout:g} s): {self.inflight} sequences running "
                                   f"({self._limit_said()}), {self.queued} waiting",
                                   self.retry_after()) from None
        except BaseException:  # cancelled (the client went away): leave the line
            self.release(t)
            raise
        return t

    def release(self, t: Ticket) -> None:
        """Give back t's slots, or its place in line; safe to call more than once."""
        if t.released:
            return
        t.released = True
        if t.granted_at is None:
            self._line.remove(t)
            self.queued -= t.n
        else:
            self.inflight -= t.n
            held = self.clock() - t.granted_at
            self._hold = held if self._hold is None else self._hold + HOLD_WEIGHT * (
                held - self._hold)
        self.refresh()

    def refresh(self) -> None:
        """Start whoever the limit lets through now (also when the decode slots grew)."""
        # In FIFO order, and only from the head: a request for many slots is not overtaken
        # for ever by small ones.
        limit = self.limit()
        while self._line and self._room(self._line[0].n, limit):
            head = self._line.popleft()
            self.queued -= head.n
            self._start(head)

    def limit(self) -> int:
        """Sequences that may run now: max_inflight, or fewer when the free decode slots are."""
        slots = self.slots()
        return self.max_inflight if slots is None else min(self.max_inflight, slots.free)

    def expected_wait(self, n: int = 1) -> float:
        """Seconds a request for n slots arriving now would wait (0 until a hold is measured)."""
        if self._fits(n) or self._hold is None:
            return 0.0
        return self._to_start(self.queued + n)

    def retry_after(self) -> int:
        """Whole seconds until the present line should have cleared, 1 to the queue timeout."""
        wait = 0.0 if self._hold is None else self._to_start(self.queued)
        return max(1, math.ceil(min(wait, self.timeout)))

    def _to_start(self, waiting: int) -> float:
        """Seconds until `waiting` slots in line have started. Running sequences end at about
        max(inflight, limit) per average hold; while more run than the limit (it fell: a decode
        worker left, or other controllers hold more of the slots than they did) the first of
        them to end start nobody."""
        assert self._hold is not None
        limit = self.limit()
        return self._hold * (max(0, self.inflight - limit) + waiting) / max(1, self.inflight, limit)

    def _fits(self, n: int) -> bool:
        return not self._line and self._room(n, self.limit())

    def _room(self, n: int, limit: int) -> bool:
        # A request for more sequences than all the decode slots runs alone rather than never.
        # One that fits waits for slots other controllers hold: they end, and heartbeats say so.
        return self.inflight + n <= limit or (self.inflight == 0 and n > self._capacity())

    def _capacity(self) -> int:
        slots = self.slots()
        return self.max_inflight if slots is None else min(self.max_inflight, slots.total)

    def _limit_said(self) -> str:
        slots = self.slots()
        if slots is None or slots.free >= self.max_inflight:
            return f"--max-inflight {self.max_inflight}"
        said = f"the decode workers run {slots.total} at once"
        if slots.free < slots.total:
            said += f", other controllers hold {slots.total - slots.free} of them"
        return said

    def _check_size(self, n: int) -> None:
        if n > self.max_inflight:
            raise TooManySequences(n, self.max_inflight)

    def _start(self, t: Ticket) -> None:
        t.granted_at = self.clock()
        self.inflight += t.n
        t.granted.set()
