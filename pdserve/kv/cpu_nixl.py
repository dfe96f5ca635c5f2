"""NixlConnector for CPU hosts: same transfers, no spinning thread, no stolen core.

vLLM 0.32's NIXL worker does two things that hurt a CPU-only host (measured in issue 7):
1. it builds the NIXL agent with the default config, whose UCX progress thread polls with
   zero delay and keeps a whole core busy even when nothing moves;
2. it pins the engine's main thread to the last core of each NUMA node "to reserve cores for
   KV loads", so every engine on a one-node machine computes on the same core, whatever
   VLLM_CPU_OMP_THREADS_BIND said.

This subclass is loaded through vLLM's out-of-tree hook (``kv_connector_module_path``). On the
CPU platform it builds the agent with a progress thread that sleeps between polls (a decode
engine's agent with none: its own thread moves its reads), puts the thread affinity back to what
the engine had, posts each step's reads before its forward rather than after, and reads a
prompt's KV inside the step that computes its next position when no other stream waits for it
(an idle decode engine, or a peer whose reads are copied as they are posted), sending vLLM's
notices to prefill engines only after the step's reads (kv/notices.py). On any
platform it is loaded on (pdserve loads it on CPU hosts; GPU hosts get vLLM's NixlConnector) it
fails the engine's start when its side-channel port is taken (vLLM would wait for it for good),
caps a decode read at what the prefill computed, reports what each read moved and frees, when
its worker asks, the blocks of a prefill whose end never reached a controller.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from pdserve.kv.copy_scope import copy_scope
from pdserve.kv.notices import HeldNotices
from pdserve.net import bind_error
from pdserve.protocol import KV_READ_STATS, RELEASE_HELD, leg_of

# Under vLLM's logger: this runs in the engine's processes, where only vLLM's handler exists
# (a "pdserve.*" logger there has none, and its INFO lines were lost).
logger = init_logger(f"vllm.{__name__}")

CONNECTOR_NAME = "PDCpuNixlConnector"


# How long NIXL's UCX progress thread sleeps between polls, in microseconds. NIXL's Python
# wrapper hard-codes 0 (poll without pause: a whole core). The thread must exist: without it a
# prefill engine that is idle while holding blocks never answers a new decode peer's UCX
# wire-up, and that peer's read waits until the blocks' lease expires.
PROGRESS_DELAY_US = int(os.environ.get("PDSERVE_NIXL_PROGRESS_DELAY_US", "2000"))


# A decode engine's agent has no progress thread: the engine's own thread moves its reads, while
# it waits for an in-step read, at each attention layer of a step with reads in flight and at
# each step's end. UCX over TCP has no remote read: the prefill engine sends the blocks back as
# messages, and the reader must take them in. With a progress thread beside the engine's own
# polling on the engine's core, reads stalled 2-6 ms at a time (a 1.5 MB read took 3.2 ms at
# p50, 1.35 ms without the thread: docs/performance.md, "The read itself"). A prefill engine
# keeps its thread: nothing else answers a read while it is idle. "1" gives a decode engine its
# thread back.
DECODE_PROGRESS_THREAD = os.environ.get("PDSERVE_NIXL_DECODE_THREAD", "0") == "1"


def has_progress_thread(kv_role: str) -> bool:
    """Whether the NIXL agent of an engine in this KV role gets a progress thread."""
    return kv_role != "kv_consumer" or DECODE_PROGRESS_THREAD


@contextlib.contextmanager
def cpu_agent(progress_thread: bool) -> Iterator[None]:
    """Build the NIXL agent made inside this block with a progress thread polling every
    PROGRESS_DELAY_US, or without one."""
    wrapper = base_worker.NixlWrapper
    api = sys.modules.get(getattr(wrapper, "__module__", ""), None)
    bind = getattr(api, "nixlBind", None)
    if bind is None:  # NIXL missing or laid out differently: let the parent do its own thing
        yield
        return
    original = bind.nixlAgent

    def make_agent(name, config):
        config.pthrDelay = PROGRESS_DELAY_US
        config.useProgThread = progress_thread
        return original(name, config)

    bind.nixlAgent = make_agent
    try:
        yield
    finally:
        bind.nixlAgent = original


# How long an engine step that ran no model may wait for the KV reads in flight before it
# reports what is done. vLLM's engine notices a finished read only at the end of a step and
# sleeps 1 ms after every step that ran no model, so a read that lands just after the check
# costs that sleep and another step; most land within a millisecond of being posted.
READ_WAIT_S = int(os.environ.get("PDSERVE_NIXL_READ_WAIT_US", "1000")) / 1e6
_POLL_S = 50e-6


# A decode engine can read a prompt's KV inside the step that computes the prompt's next
# position (vLLM's synchronous load: posted before the forward, which waits for it).
# Read on its own (vLLM's asynchronous load), it is noticed at the end of a step that ran no
# model, then the engine sleeps 1 ms and schedules the request at the next step: about 2-3 ms
# more per handoff on an idle engine, a whole step more on a busy one. With other requests in
# the engine the read is in the step only from a prefill engine in the reader's copy scope
# (kv/copy_scope.py) one of whose reads has landed as it was posted: UCX's cma (engines on one
# host) copies a read inside the call that posts it, which the step makes before it prepares its
# inputs, so the others' forward does not wait for the bytes. (NIXL flushes a read's UCX
# endpoint, whose TCP lane, once it has sent the holder a message, such as the notice of the
# read before, flushes only when the holder answers: kv/notices.py sends the notices after the
# step's reads and flushes them. A read that still has not landed as posted, its peer's answer
# late, waits for the holder's progress thread, and for good on a stopped holder; one landed as
# posted suffices to mark the peer.) A read over TCP lands only once the holder has answered,
# and its stalls would pause every stream in the engine; it seems to land as posted when the
# reader is descheduled between posting and checking it, hence the scope.
IN_STEP_READS = os.environ.get("PDSERVE_NIXL_IN_STEP_READS", "1") != "0"
# A read in the step that has not landed by then stops the engine (its worker exits, `pdserve
# serve` restarts it, the controller retries the leg): the step cannot compute without the KV,
# and a read given up on could still write into the request's blocks.
IN_STEP_TIMEOUT_S = 10.0
# On the metadata the scheduler sends a step's workers: the requests whose reads are in the step.
_IN_STEP = "pdserve_in_step"
_MAX_PEERS = 1024  # prefill engines remembered as read from (a restarted one has a new id)
# On the metadata: the prefill legs whose held blocks are to be freed (RELEASE_HELD).
_RELEASE = "pdserve_release"
# In the kv_transfer_params a prefill engine hands its decode: the prefill engine's copy scope.
_COPY_SCOPE = "pdserve_copy_scope"


class SideChannelTaken(RuntimeError):
    """The KV side-channel port is taken: the engine cannot start."""


class InStepReadTimeout(RuntimeError):
    """A KV read inside a step did not land within IN_STEP_TIMEOUT_S: the engine must stop."""


class ReadsLanded(KVConnectorWorkerMetadata):
    """Worker -> scheduler: when each read inside this step landed (monotonic clock), and for
    each read posted as this step began, whether it had landed as it was posted."""

    def __init__(self, landed: dict[str, float], quick: dict[str, bool] | None = None):
        self.landed = landed
        self.quick = quick or {}

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return ReadsLanded({**self.landed, **getattr(other, "landed", {})},
                           {**self.quick, **getattr(other, "quick", {})})


def _as_unread(blocks: KVCacheBlocks, hits: int, held: int) -> KVCacheBlocks:
    """A synchronous load's blocks as vLLM's NIXL scheduler expects an asynchronous one's, to
    choose what to read: the first `held` (all that hold the prefill's KV), the engine's own
    prefix-cache hits (the first `hits`) hashed and the rest not. vLLM caches the blocks a
    synchronous load fills as it allocates them (an asynchronous one's once the read is done),
    which NIXL would take for hits and not read, and allocates the step's new position too (an
    asynchronous load's comes at a later step), which NIXL would try to read. All `held` are
    read, even when the step computes a whole prompt's last position again: vLLM's reader
    pairs the blocks it is given with the prefill's last ones, so one fewer (a prompt of
    k blocks and one token) would put each block's KV in the block before."""
    return KVCacheBlocks(tuple(
        [b if i < hits or b.is_null else KVCacheBlock(block_id=b.block_id)
         for i, b in enumerate(group[:held])]
        for group in blocks.blocks))


class PDCpuNixlConnector(NixlPullConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        # Decode side (scheduler): request id -> [tokens its prefix cache had, tokens to read,
        # when the read was asked for, when it was done, 1 if it was in-step]
        # (protocol.KV_READ_STATS).
        self._reads: dict[str, list[float]] = {}
        self._wait_for_reads = False  # worker side: this step ran no model, so it may wait
        self._may_wait = current_platform.is_cpu() and READ_WAIT_S > 0
        self._post_early = current_platform.is_cpu()  # worker side: reads go out as steps begin
        # In-step reads. Scheduler side: the requests holding blocks here, the prefill engines
        # read from before (their handshake is done), the engine each read comes from and
        # whether it is in this engine's copy scope, the reads chosen to be in-step, and those
        # sent to the workers until they report them.
        # One KV cache group: vLLM reports a failed read as invalid blocks only then (and the
        # scheduler fails an in-step read's request from them).
        self._may_read_in_step = (current_platform.is_cpu() and IN_STEP_READS
                                  and len(getattr(kv_cache_config, "kv_cache_groups", ())) == 1)
        self._live: set[str] = set()
        # Prefill engine -> whether one of its reads has landed as it was posted (so reads from
        # it are copies); the least recently read from first, at most _MAX_PEERS.
        self._peers: dict[str, bool] = {}
        self._scope = copy_scope() if current_platform.is_cpu() else None
        self._source: dict[str, tuple[str, bool]] = {}
        self._in_step_chosen: dict[str, int] = {}  # request id -> tokens the prefill holds
        self._in_step_next: set[str] = set()
        self._in_step_sent: set[str] = set()
        self._landed: dict[str, float] = {}  # worker side: in-step reads landed this step
        self._quick: dict[str, bool] = {}  # worker side: reads posted this step, landed or not
        # Held blocks no decode will read (RELEASE_HELD). Scheduler side: the legs named since
        # the last step; worker side: the engine's requests freed in this step.
        self._releases: set[str] = set()
        self._released: set[str] = set()
        self._drives_reads = False  # worker side: no progress thread, so reads move at each layer
        self._notices: HeldNotices | None = None  # worker side, an engine that reads
        if role != KVConnectorRole.WORKER or not current_platform.is_cpu():
            super().__init__(vllm_config, role, kv_cache_config)
            return
        affinity = os.sched_getaffinity(0)
        self._drives_reads = not has_progress_thread(vllm_config.kv_transfer_config.kv_role)
        with cpu_agent(progress_thread=not self._drives_reads):
            super().__init__(vllm_config, role, kv_cache_config)
        if os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        if vllm_config.kv_transfer_config.kv_role != "kv_producer":  # it reads (kv/notices.py)
            worker = self.connector_worker
            worker.nixl_wrapper = self._notices = HeldNotices(worker.nixl_wrapper)
        logger.info(
            "pdserve CPU NIXL connector: %s, affinity kept at %s",
            "reads moved by the engine's thread, no progress thread" if self._drives_reads
            else f"progress thread polls every {PROGRESS_DELAY_US} us", sorted(affinity),
        )

    # ---- the side channel (scheduler side) -------------------------------------------------

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        # vLLM's listener thread binds the side-channel port, and the engine's start waits for it
        # without a timeout: a port another process took since the worker chose it would hang
        # the start for good. Fail it with the reason instead (the worker exits, and `pdserve
        # serve` restarts it with another port).
        sched = self.connector_scheduler
        if sched is not None and getattr(sched, "_nixl_handshake_listener_t", None) is None:
            host, port = sched.side_channel_host, sched.side_channel_port
            if (err := bind_error(host, port)) is not None:
                raise SideChannelTaken(
                    f"the KV side channel cannot listen on {host}:{port} ({err}): another "
                    "process holds the port; start the worker again (without --kv-port it "
                    "picks another free one) or give it a free --kv-port")
        super().set_xfer_handshake_metadata_pp_aware(metadata)

    # ---- a read that lands within the step is reported by it (worker side, CPU) ------------

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # vLLM's model runner calls this with the step's metadata before it prepares the step's
        # inputs; it posts an asynchronous read only after the forward (on a GPU the forward is
        # launched by then, on a CPU it is done), so the read moves during the next step and
        # its request computes in the one after. Posted here, every read moves during this
        # step's forward: an in-step read while the inputs are prepared (~2 ms on a CPU host;
        # start_load_kv then waits for it), an asynchronous one in time for this step's end.
        super().handle_preemptions(kv_connector_metadata)
        pending = kv_connector_metadata.reqs_to_recv
        if self._post_early and pending and self.connector_worker is not None:
            early = NixlConnectorMetadata()
            early.reqs_to_recv, kv_connector_metadata.reqs_to_recv = pending, {}
            self.connector_worker.start_load_kv(early)
            self._note_quick(pending)
            self._send_notices()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # vLLM runs a step without a model (no attention metadata) only to move KV.
        self._wait_for_reads = (self._may_wait
                                and getattr(forward_context, "attn_metadata", None) is None)
        super().start_load_kv(forward_context, **kwargs)
        if in_step := getattr(self._connector_metadata, _IN_STEP, None):
            self._land(in_step, time.monotonic() + IN_STEP_TIMEOUT_S)
        self._send_notices()
        if legs := getattr(self._connector_metadata, _RELEASE, None):
            self._release(legs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Called before each attention layer of a step's forward: a decode engine without a
        # progress thread takes in what its reads in flight have received so far.
        if self._drives_reads:
            self._progress_reads()

    def _progress_reads(self) -> None:
        for handles in list(self.connector_worker._recving_transfers.values()):
            self._in_flight(handles)  # NIXL moves the agent's transfers as it checks one

    def _land(self, req_ids: set[str], deadline: float) -> None:
        """Wait until the reads of `req_ids` have landed or failed (vLLM reports a failure, and
        the scheduler fails the request), posting those whose peer's handshake just ended."""
        worker = self.connector_worker
        waiting = set(req_ids)
        while True:
            while not worker._ready_requests.empty():  # as vLLM's start_load_kv does
                worker._read_blocks_for_req(*worker._ready_requests.get_nowait())
            for req_id in [r for r in waiting if self._settled(r)]:
                waiting.discard(req_id)
                self._landed[req_id] = time.monotonic()
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise InStepReadTimeout(
                    f"the KV reads of {sorted(waiting)} did not land within "
                    f"{IN_STEP_TIMEOUT_S:.0f} s inside an engine step")
            time.sleep(_POLL_S)

    def _send_notices(self) -> None:
        """The notices of the reads done so far, and a flush after them (kv/notices.py)."""
        if self._notices is not None:
            self._notices.send()

    def _note_quick(self, req_ids) -> None:
        """Note whether each of these reads, just posted, has landed already (one whose peer's
        handshake is under way is not posted)."""
        worker = self.connector_worker
        for req_id in req_ids:
            if (handles := worker._recving_transfers.get(req_id)) is not None:
                self._quick[req_id] = self._landed_whole(handles)

    def _landed_whole(self, handles: list[int]) -> bool:
        try:
            return all(self.connector_worker.nixl_wrapper.check_xfer_state(h) == "DONE"
                       for h in handles)
        except Exception:
            return False

    def _settled(self, req_id: str) -> bool:
        worker = self.connector_worker
        if req_id in worker._recv_failures or req_id in worker._failed_recv_reqs.queue:
            return True
        handles = worker._recving_transfers.get(req_id)
        if handles is None:  # not posted yet: its peer's handshake is under way
            return False
        return not self._in_flight(handles)

    def _in_flight(self, handles: list[int]) -> bool:
        """Whether any of these transfers is still moving (a failed one is not: vLLM's own
        check reports it)."""
        try:
            return any(self.connector_worker.nixl_wrapper.check_xfer_state(h) == "PROC"
                       for h in handles)
        except Exception:
            return False

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        landed, self._landed = self._landed, {}
        quick, self._quick = self._quick, {}
        return ReadsLanded(landed, quick) if landed or quick else None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        if self._wait_for_reads:
            self._until_reads_land(time.monotonic() + READ_WAIT_S)
        results = super().get_transfer_results(finished_req_ids)
        self._send_notices()
        if self._released:  # as if their decodes had read them: the scheduler frees the blocks
            results.finished_sending = set(results.finished_sending or ()) | self._released
            self._released = set()
        return results

    def _until_reads_land(self, deadline: float) -> None:
        """Poll the reads in flight until none is in progress, or the deadline."""
        transfers = getattr(self.connector_worker, "_recving_transfers", None)
        while transfers and time.monotonic() < deadline:
            if not any(self._in_flight(handles) for handles in transfers.values()):
                return
            time.sleep(_POLL_S)

    # ---- held blocks no decode will read (a prefill leg aborted as it ended) ---------------

    def _asks_release(self, request: Any) -> bool:
        """Scheduler side: whether this request only names prefill legs whose held blocks are
        to be freed (the worker sends it finished at once: vLLM's abort of a request that has
        already finished does nothing, and its blocks would wait for their lease)."""
        legs = (request.kv_transfer_params or {}).get(RELEASE_HELD)
        if legs is None:
            return False
        self._releases.update(legs)
        return True

    def _release(self, legs: set[str]) -> None:
        """Worker side: stop holding the blocks of these legs' finished prefills. The engine
        names a request by its leg's id, a dash and 8 characters of its own
        (vLLM's InputProcessor.assign_request_id); a controller with no decode worker to
        carry a release names it that way (the prefill's `remote_request_id`). A leg still
        running is not held: its abort frees it."""
        worker = self.connector_worker
        for req_id in [r for r in worker._reqs_to_send
                       if r in legs or leg_of(r) in legs]:
            del worker._reqs_to_send[req_id]
            worker._reqs_to_process.discard(req_id)
            self._released.add(req_id)
            logger.info("freed the KV blocks of %s at its worker's word: no decode will read "
                        "them", req_id)

    # ---- what a decode read moved (scheduler side), reported with the request's end --------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        count, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            # Read no further than the prefill computed. vLLM's reader asks for the whole
            # prompt, but a decode leg whose context is the prompt plus the prefill's sampled
            # token (controller/sequence.py) has one position more: its KV is computed here,
            # where that token is sampled from, so the next token comes a step sooner.
            held = params.get("remote_num_tokens")
            if count and held:
                count = max(0, min(count, held - num_computed_tokens))
                is_async = is_async and count > 0
            in_scope = self._scope is not None and params.get(_COPY_SCOPE) == self._scope
            self._source[request.request_id] = (params.get("remote_engine_id"), in_scope)
            self._in_step_chosen.pop(request.request_id, None)
            # The step computes at least one position: the prefill's token's, or, when the
            # context is the whole prompt, its last one again (as vLLM's scheduler does once
            # an asynchronous read of the whole prompt is done).
            in_step = min(count or 0, request.num_tokens - 1 - num_computed_tokens)
            if is_async and in_step > 0 and self._read_in_step(request):
                self._in_step_chosen[request.request_id] = num_computed_tokens + count
                count, is_async = in_step, False
            # vLLM's reader pulls only the blocks past the engine's own prefix-cache hit.
            self._reads[request.request_id] = [num_computed_tokens, count or 0, 0.0, 0.0, 0.0]
        return count, is_async

    def _read_in_step(self, request: Any) -> bool:
        """Whether this read can be in the step that computes the request's next position: the
        peer was read from before (no handshake inside the step), the read lands straight in
        the engine's blocks, and no other stream's step waits for it: the engine holds no other
        request, or the peer is in this engine's copy scope and one of its reads has landed as
        it was posted."""
        sched = self.connector_scheduler
        engine, _ = self._source.get(request.request_id, (None, False))
        if not (self._may_read_in_step and engine in self._peers
                and sched is not None and not sched.use_host_buffer):
            return False
        return self._peers[engine] or not self._live - {request.request_id}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self._live.add(request.request_id)
        read = self._reads.get(request.request_id)
        if read is not None and num_external_tokens:
            read[2] = time.monotonic()  # the read goes out with this step's metadata
        covered = self._in_step_chosen.pop(request.request_id, None)
        if covered is not None and num_external_tokens and read:
            self._in_step_next.add(request.request_id)
            read[4] = 1.0
            size = self.connector_scheduler.block_size
            blocks = _as_unread(blocks, int(read[0]) // size, -(-covered // size))
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._releases:
            setattr(meta, _RELEASE, self._releases)
            self._releases = set()
        if self._in_step_next:
            setattr(meta, _IN_STEP, self._in_step_next)
            self._in_step_sent |= self._in_step_next
            self._in_step_next = set()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        now = time.monotonic()
        worker_meta = connector_output.kv_connector_worker_meta
        landed = getattr(worker_meta, "landed", {})
        finished = connector_output.finished_recving or set()
        failed = connector_output.failed_recving or set()
        for req_id, quick in getattr(worker_meta, "quick", {}).items():
            if (source := self._source.get(req_id)) is not None:
                engine, in_scope = source
                self._read_from(engine, quick and in_scope)
        for req_id in finished:
            if (read := self._reads.get(req_id)) is not None:
                read[3] = landed.get(req_id, now)
            if req_id not in failed and (source := self._source.get(req_id)) is not None:
                self._read_from(source[0], None)
        if in_step := finished & self._in_step_sent:
            # The scheduler takes a finished read as a request waiting for it to be scheduled,
            # and an in-step read's request was scheduled with it. A failed one is failed by
            # vLLM from its blocks (invalid_block_ids).
            connector_output.finished_recving = finished - in_step
            self._in_step_sent -= in_step

    def _read_from(self, engine: str, quick: bool | None) -> None:
        """Remember a prefill engine as read from, the newest last; `quick`: whether its read,
        in this engine's copy scope, had landed as it was posted (a peer once seen so keeps it:
        its reads can be copies)."""
        self._peers[engine] = self._peers.pop(engine, False) or bool(quick)
        if len(self._peers) > _MAX_PEERS:  # prefill engines that came and went
            del self._peers[next(iter(self._peers))]

    def request_finished(self, request: Any, block_ids: Any):
        if self._asks_release(request):
            return False, None
        delay, params = super().request_finished(request, block_ids)
        return delay, self._with_read(request, self._with_scope(params))

    def request_finished_all_groups(self, request: Any, block_ids: Any):
        if self._asks_release(request):
            return False, None
        delay, params = super().request_finished_all_groups(request, block_ids)
        return delay, self._with_read(request, self._with_scope(params))

    def _with_scope(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """A prefill's params for its decode, with this engine's copy scope."""
        if not params or self._scope is None or "remote_engine_id" not in params:
            return params
        return {**params, _COPY_SCOPE: self._scope}

    def _with_read(self, request: Any, params: dict[str, Any] | None) -> dict[str, Any] | None:
        self._live.discard(request.request_id)
        self._source.pop(request.request_id, None)
        self._in_step_chosen.pop(request.request_id, None)
        read = self._reads.pop(request.request_id, None)
        if read is None or not (request.kv_transfer_params or {}).get(KV_READ_STATS):
            return params
        return {**(params or {}), KV_READ_STATS: read}
