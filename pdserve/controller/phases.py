"""The KV handoff split into phases, from clocks that can be compared (pure).

The handoff is the time from the prefill's result reaching the controller to the decode worker's
first new token reaching it. Its phases, each measured where it happens:

- controller: prefill result in -> decode leg sent (the controller's own clock)
- transit: both hops, controller -> decode worker and back, whatever the hosts' clocks say (the
  leg's round trip at the controller minus the time it spent at the worker)
- worker_in: the decode worker's own time from Generate in to its engine queuing the request
- schedule: the engine queued the request -> asked for its KV (allocated its blocks)
- kv_read: asked for the KV -> the read done (NIXL; pdserve's connector notes both)
- first_step: the read done -> the engine's first token (it computes one position: the prefill's
  token's, or the last prompt position again when the token must be drawn again)
- worker_out: the decode worker's own time from its engine's first token to that output sent

The worker host's times (protocol.Output.timings, KV_READ_STATS) are on its monotonic clock,
which its engine core shares. Without the connector's read times, kv_read is part of
first_step (from the engine's own "scheduled" time).
"""

from __future__ import annotations

from dataclasses import dataclass

PHASES = ("controller", "transit", "worker_in", "schedule", "kv_read", "first_step",
          "worker_out")


def handoff_phases(prefill_out: float, decode_sent: float, first_out: float,
                   timings: list[float], read: tuple[float, float] | None = None,
                   ) -> dict[str, float]:
    """Seconds per phase. `timings`: [Generate received, engine queued, engine scheduled,
    engine first token, output sent] on the worker; `read`: (asked, done) on the same clock."""
    received, queued, scheduled, first_token, sent = timings
    out = {"controller": decode_sent - prefill_out,
           "transit": (first_out - decode_sent) - (sent - received),
           "worker_in": queued - received, "worker_out": sent - first_token}
    if read is not None and read[0] and read[1]:
        asked, done = read
        out.update(schedule=asked - queued, kv_read=done - asked, first_step=first_token - done)
    else:
        out.update(schedule=scheduled - queued, first_step=first_token - scheduled)
    return {k: max(0.0, v) for k, v in out.items()}


@dataclass
class HandoffClock:
    """One handoff's times as the controller sees them (its monotonic clock), and the decode
    worker's report."""

    prefill_out: float
    decode_sent: float = 0.0
    first_out: float = 0.0
    timings: list[float] | None = None

    def phases(self, read: tuple[float, float] | None) -> dict[str, float] | None:
        if not (self.decode_sent and self.first_out and self.timings
                and len(self.timings) == 5):
            return None
        return handoff_phases(self.prefill_out, self.decode_sent, self.first_out,
                              self.timings, read)
