"""A decode engine's notices to prefill engines, sent after the step's reads, then flushed.

vLLM's reader has NIXL tell the prefill engine when a read is done (a notice, one message to it),
and NIXL flushes a read's UCX endpoint as part of the read. Over UCX's TCP lane, an endpoint
that has sent a message since its last flush flushes only once the peer has answered. So a read
after a notice to the same prefill engine, even one UCX copies itself over cross-memory attach,
was done only once that engine's progress thread had answered: up to 24 ms on a busy host,
inside the step for an in-step read (docs/performance.md). Here a step's reads go out without notices;
the notices follow once the reads are posted and done, and then a one-byte read with no notice,
which flushes the endpoint while the step computes: the next step's reads wait for nothing
unless the prefill engine has not answered by then.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np

logger = logging.getLogger(f"vllm.{__name__}")  # runs in the engine: vLLM's handler only

_LOCAL = ("", "NIXL_INIT_AGENT")  # prep_xfer_dlist's names for this agent's own descriptors
_MAX_PEERS = 1024  # prefill engines flushed (a restarted one is a new peer)


class HeldNotices:
    """vLLM's NIXL agent, as its reader calls it: reads go out without their notices, which
    `send` sends once each read is done, with those vLLM sends on their own, and then flushes
    each peer sent one. Anything else goes to the agent as it is."""

    def __init__(self, agent: Any):
        self._agent = agent
        self._peer_of: dict[Any, str] = {}  # a peer's prepared descriptor list -> the peer
        self._byte_of: dict[str, int] = {}  # peer -> an address in its registered memory
        self._reads: dict[Any, tuple[str, bytes]] = {}  # read in flight -> its notice
        self._due: list[tuple[str, bytes]] = []
        self._flusher = _Flusher(agent)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, *args: Any, **kwargs: Any) -> Any:
        handle = self._agent.prep_xfer_dlist(agent_name, xfer_list, *args, **kwargs)
        if agent_name not in _LOCAL:
            self._peer_of[handle] = agent_name
            with contextlib.suppress(IndexError, TypeError, ValueError):
                self._byte_of[agent_name] = int(xfer_list[0][0])
        return handle

    def make_prepped_xfer(self, operation: str, local: Any, local_ids: Any, remote: Any,
                          remote_ids: Any, notif_msg: bytes = b"", *args: Any,
                          **kwargs: Any) -> Any:
        peer = self._peer_of.get(remote) if notif_msg else None  # else NIXL sends it, as ever
        handle = self._agent.make_prepped_xfer(operation, local, local_ids, remote, remote_ids,
                                               notif_msg if peer is None else b"", *args, **kwargs)
        if peer is not None:
            self._reads[handle] = (peer, notif_msg)
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> str:
        return self._seen(handle, self._agent.transfer(handle, *args, **kwargs))

    def check_xfer_state(self, handle: Any) -> str:
        return self._seen(handle, self._agent.check_xfer_state(handle))

    def release_xfer_handle(self, handle: Any) -> Any:
        self._reads.pop(handle, None)  # not seen done: NIXL would not have sent its notice
        return self._agent.release_xfer_handle(handle)

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, *args: Any,
                   **kwargs: Any) -> None:
        self._due.append((remote_agent_name, notif_msg))

    def remove_remote_agent(self, agent: str) -> Any:
        self._flusher.forget(agent)
        self._due = [d for d in self._due if d[0] != agent]
        self._byte_of.pop(agent, None)
        # list() copies at once: vLLM's handshake thread may be adding a peer's list meanwhile.
        for dlist, peer in list(self._peer_of.items()):
            if peer == agent:
                del self._peer_of[dlist]
        return self._agent.remove_remote_agent(agent)

    @property
    def flushing(self) -> bool:
        """Whether a flush is in flight (`send` moves it)."""
        return bool(self._flusher.moving)

    def send(self) -> None:
        """Send the notices due, then flush the endpoint of each peer sent one."""
        self._flusher.progress()
        due, self._due = self._due, []
        for peer, message in due:
            try:
                self._agent.send_notif(peer, notif_msg=message)
            except Exception as e:
                logger.warning("a KV notice to %s failed (%s): its blocks are freed when their "
                               "lease ends", peer, e)
        for peer in dict.fromkeys(peer for peer, _ in due):
            if (address := self._byte_of.get(peer)) is not None:
                self._flusher.flush(peer, address)

    def _seen(self, handle: Any, state: str) -> str:
        if state == "DONE" and (notice := self._reads.pop(handle, None)) is not None:
            self._due.append(notice)
        elif state == "ERR":
            self._reads.pop(handle, None)  # NIXL sends no notice for a failed read
        return state


class _Flusher:
    """One-byte reads with no notice, one per peer, each posted again when flushed anew."""

    def __init__(self, agent: Any):
        self._agent = agent
        self._byte: np.ndarray = np.zeros(1, dtype=np.uint8)  # where they land
        agent.register_memory([(self._byte.ctypes.data, 1, 0, "")], "DRAM")
        self._local = agent.get_xfer_descs([(self._byte.ctypes.data, 1, 0)], "DRAM")
        self._reads: dict[str, Any] = {}  # peer -> its one-byte read, the oldest first
        self.moving: set[str] = set()
        self._owed: set[str] = set()  # peers to flush again once their flush in flight is done

    def flush(self, peer: str, address: int) -> None:
        """Flush `peer`'s endpoint; `address`: a byte of its registered memory."""
        if peer in self.moving:
            self._owed.add(peer)
            return
        if peer not in self._reads:
            try:
                remote = self._agent.get_xfer_descs([(address, 1, 0)], "DRAM")
                self._reads[peer] = self._agent.initialize_xfer("READ", self._local, remote,
                                                                peer)
            except Exception as e:  # the peer is going: its own reads fail and say so
                logger.debug("no KV flush for %s: %s", peer, e)
                return
            self._evict()
        self._post(peer)

    def progress(self) -> None:
        for peer in list(self.moving):
            try:
                state = self._agent.check_xfer_state(self._reads[peer])
            except Exception:
                state = "ERR"
            if state == "PROC":
                continue
            self.moving.discard(peer)
            if state != "DONE":
                self.forget(peer)
            elif peer in self._owed:
                self._owed.discard(peer)
                self._post(peer)

    def forget(self, peer: str) -> None:
        self.moving.discard(peer)
        self._owed.discard(peer)
        if (handle := self._reads.pop(peer, None)) is not None:
            with contextlib.suppress(Exception):  # NIXL may have dropped it with its peer
                self._agent.release_xfer_handle(handle)

    def _post(self, peer: str) -> None:
        try:
            state = self._agent.transfer(self._reads[peer])
        except Exception:
            state = "ERR"
        if state == "PROC":
            self.moving.add(peer)
        elif state != "DONE":
            self.forget(peer)

    def _evict(self) -> None:
        idle = [peer for peer in self._reads if peer not in self.moving]
        for peer in idle[:max(0, len(self._reads) - _MAX_PEERS)]:
            self.forget(peer)
