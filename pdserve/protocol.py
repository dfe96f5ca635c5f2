"""Wire messages between controllers and workers, and their codec.

Every message is two ZMQ frames: a 2-byte header (protocol version, message type) and a msgpack
body (msgspec, never pickle: these frames cross hosts). Structs are array-like so field names do
not travel. A peer speaking another version is refused with a message naming both versions.

Channels (one DEALER per worker per controller, one ROUTER per controller):
  worker -> controller: Register, Heartbeat, Drain, Unregister, Output, Outputs, KvEvents, Others
  controller -> worker: RegisterAck, Generate, Abort, Ping, Leave, KvReplay, Reserved

Fields are only ever added at the end, with a default: a peer of the same version that predates
them ignores them (msgspec skips trailing array items), and a message type it does not know is
dropped with a warning (so a new type goes only to a peer whose Register or RegisterAck says it
knows it).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

PROTOCOL_VERSION = 3  # 3: Outputs (an older controller would drop them)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a 128k-token prompt is ~0.5 MB; anything near this is bogus


class ProtocolError(Exception):
    """A frame that cannot be decoded: truncated, unknown type, wrong version or bad body."""


class VersionMismatch(ProtocolError):
    def __init__(self, theirs: int):
        super().__init__(f"peer speaks pdserve protocol v{theirs}, this process speaks "
                         f"v{PROTOCOL_VERSION}")
        self.theirs = theirs


class Role(enum.IntEnum):
    """A worker's role; PREFILL and DECODE also name the two sides of a request. An AUTO
    worker's engine can do both; each controller gives it a duty (PREFILL, DECODE or BOTH) and
    changes it with the load (controller/planning.py)."""

    PREFILL = 1
    DECODE = 2
    BOTH = 3
    AUTO = 4

    @property
    def label(self) -> str:
        """"prefill", "decode" or "both", as the command line, /pd/workers and metrics say it."""
        return self.name.lower()

    def serves(self, side: Role) -> bool:
        """Whether a worker of this role (or duty) takes work on `side` (PREFILL or DECODE)."""
        return self in (side, Role.BOTH, Role.AUTO)


class Phase(enum.IntEnum):
    """What a Generate asks of a worker."""

    PREFILL = 1  # compute the prompt's KV, keep it for a decode worker, return one token
    DECODE = 2  # pull the prompt's KV from a prefill worker, then decode
    LOCAL = 3  # prefill and decode here (no handoff)
    # Free a prefill worker's blocks that no decode will read (the request was aborted between
    # prefill and decode): a decode worker tells the prefill worker's connector to let them go.
    RELEASE = 4


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


class EngineInfo(_Msg):
    """Engine settings that must agree across a pool for a KV handoff to be valid."""

    model: str
    tokenizer: str
    block_size: int
    dtype: str
    kv_connector: str
    max_model_len: int

    def mismatches(self, other: EngineInfo) -> list[str]:
        return [
            f"{name}: worker has {getattr(other, name)!r}, controller expects {getattr(self, name)!r}"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]


class Load(_Msg):
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of the engine's KV blocks in use
    # Since the last heartbeat: the mean gap between a decoding stream's consecutive outputs
    # (one engine step as the worker sees it; 0: no stream decoded), and the mean number of
    # streams it was sending then (the controllers' cost models fit step time against it).
    step_s: float = 0.0
    step_running: float = 0.0
    # Requests the worker holds for other controllers as this heartbeat leaves (each controller
    # gets its own figure): slots of its engine this controller cannot have (admission.py).
    # Last: fields are positional on the wire, and a peer one version older ignores a trailing one.
    others: int = 0


class Register(_Msg):
    worker_id: str
    role: Role
    address: str  # host peers use to reach this worker's KV side channel
    info: EngineInfo
    kv_port: int = 0
    pid: int = 0
    # The engine publishes its prefix cache's KV events (relayed as KvEvents), its KV cache
    # has this many blocks, and one block of KV is this many bytes (what a handoff moves).
    kv_events: bool = False
    kv_blocks: int = 0
    kv_block_bytes: int = 0
    # The same in every Register the worker resends until one is acknowledged, new once it
    # registers again (after dropping its legs): a resent one is not a restart.
    session: str = ""
    # Requests its engine runs at once (vLLM's --max-num-seqs; 0: unknown): the decode streams
    # it can take; the controller holds back the prefill of any more (admission.py). Last:
    # fields are positional on the wire, and a peer one version older ignores a trailing one.
    max_seqs: int = 0
    reserves: bool = False  # it takes Reserved and sends Others


class RegisterAck(_Msg):
    accepted: bool
    reason: str = ""
    controller_id: str = ""
    heartbeat_interval: float = 1.0
    # Sent in answer to a heartbeat from a worker the controller does not know (it restarted,
    # or expired the worker): register again.
    reregister: bool = False
    # The controller declares a worker it has not heard from for this many seconds dead; the
    # worker gives up on a controller silent for as long (0: not said).
    dead_after: float = 0.0
    # Worker ports of the other API servers at this controller's address (`--api-servers N`):
    # the worker registers with them too (worker/discovery.py).
    siblings: list[int] = []
    reserves: bool = False  # it takes Others (and sends Reserved to a worker that reserves)


class Heartbeat(_Msg):
    worker_id: str
    load: Load
    draining: bool = False


class Reserved(_Msg):
    """Controller -> decode worker: how many of this controller's streams are headed there now
    (the worker was chosen for them; their prompts are being prefilled elsewhere). The worker
    counts them among the slots other controllers cannot have, and tells those at once."""

    count: int


class Others(_Msg):
    """Decode worker -> controller, between heartbeats: its Load.others changed because another
    controller reserved slots there. A burst reaching two controllers at once let each admit
    every slot while the figure waited for the next heartbeat (controller/admission.py)."""

    worker_id: str
    others: int


class Drain(_Msg):
    """The worker takes no new requests; it finishes what it has, then unregisters."""

    worker_id: str


class Unregister(_Msg):
    worker_id: str
    reason: str = ""


class Generate(_Msg):
    request_id: str
    phase: Phase
    prompt_token_ids: list[int]
    # vllm.SamplingParams encoded with msgspec; decoded by the worker (keeps this module free
    # of vLLM so that the codec and the control plane load fast).
    sampling_params: msgspec.Raw
    kv_transfer_params: dict[str, Any] | None = None
    # Tokens the engine must draw first, in order (tokens the client already has: the prefill's
    # token on a decode leg, tokens replayed after a migration); sampled as asked after them.
    forced_tokens: list[int] | None = None
    # A local leg that goes on from a prefill leg this worker finished (its id): the prompt's
    # KV is in the engine's cache, and no decode worker was left to read it. A draining worker
    # takes it (the second half of a request it already served), as it takes releases.
    continues: str | None = None


class Abort(_Msg):
    request_ids: list[str]


class Ping(_Msg):
    """The controller checking that a silent worker's connection is still there (the send
    fails if it is gone); the worker needs no answer beyond its usual heartbeats."""

    controller_id: str = ""


class Leave(_Msg):
    """The controller is stopping: the legs it sent are over, and it forgets this worker."""

    controller_id: str = ""
    reason: str = ""


class KvEvents(_Msg):
    """One batch of the engine's KV cache events, as vLLM's publisher numbered and encoded it
    (a msgpack KVEventBatch: BlockStored / BlockRemoved / AllBlocksCleared)."""

    worker_id: str
    seq: int
    batch: msgspec.Raw


class KvReplay(_Msg):
    """Send this controller the engine's KV event batches from `start` on (it missed some)."""

    start: int


class TokenLogprob(_Msg):
    token_id: int
    logprob: float
    rank: int | None = None
    decoded: str | None = None


class SeqDelta(_Msg):
    """New output of one sequence since the previous Output."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[list[TokenLogprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Output(_Msg):
    request_id: str
    seqs: list[SeqDelta]
    finished: bool = False
    num_cached_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None
    error: str | None = None  # set when the worker could not run the request at all
    error_kind: int = 0  # ErrorKind
    # A decode leg's first output: when, on the worker host's monotonic clock, the worker got
    # the Generate, its engine queued it, scheduled it and drew its first token, and the worker
    # sent this (HandoffTimes; the controller splits the handoff into phases with them).
    timings: list[float] | None = None


# In a decode leg's last kv_transfer_params: [tokens its engine had cached itself, tokens whose
# KV it read from the prefill worker, when the read was asked for and when it was done (the
# worker host's monotonic clock; 0: not seen), 1 if the read was inside the step that computed
# the next position, else 0] (pdserve/kv/cpu_nixl.py, on the decode side). Only when the
# request's own kv_transfer_params asked for it with this key set to true, as a pdserve worker's
# decode leg does: any other server loading the connector would hand them to its clients.
KV_READ_STATS = "pdserve_kv_read"

# In the kv_transfer_params of a request a prefill worker sends its own engine, finished at once:
# the request ids of prefill legs whose ends never reached their controller (aborted as they
# ended), whose blocks the engine may hold for decodes that will never read them
# (pdserve/kv/cpu_nixl.py frees them).
RELEASE_HELD = "pdserve_release_held"


def leg_of(engine_request_id: str) -> str:
    """The leg an engine's request id names: vLLM's InputProcessor.assign_request_id makes it
    the leg's id, a dash and 8 characters of its own."""
    return engine_request_id.rpartition("-")[0]


class Outputs(_Msg):
    """The Outputs a worker has for one controller at one moment, in one message: an engine
    step yields a token for each of its streams, and one message per step instead of one per
    stream divides the socket, CurveZMQ and decoding costs on both sides by the streams."""

    outputs: list[Output]


class ErrorKind(enum.IntEnum):
    NONE = 0
    INVALID = 1  # the engine refused the request (bad parameters): retrying elsewhere won't help
    ENGINE = 2  # the engine failed or is dead: another worker may succeed
    DRAINING = 3  # the worker no longer takes requests
    DEAD = 4  # the worker's engine died: nothing more will run there


class MsgType(enum.IntEnum):
    REGISTER = 1
    REGISTER_ACK = 2
    HEARTBEAT = 3
    DRAIN = 4
    UNREGISTER = 5
    GENERATE = 6
    ABORT = 7
    OUTPUT = 8
    PING = 9
    LEAVE = 10
    KV_EVENTS = 11
    KV_REPLAY = 12
    OUTPUTS = 13
    RESERVED = 14
    OTHERS = 15


_TYPES: dict[MsgType, type[_Msg]] = {
    MsgType.REGISTER: Register,
    MsgType.REGISTER_ACK: RegisterAck,
    MsgType.HEARTBEAT: Heartbeat,
    MsgType.DRAIN: Drain,
    MsgType.UNREGISTER: Unregister,
    MsgType.GENERATE: Generate,
    MsgType.ABORT: Abort,
    MsgType.OUTPUT: Output,
    MsgType.PING: Ping,
    MsgType.LEAVE: Leave,
    MsgType.KV_EVENTS: KvEvents,
    MsgType.KV_REPLAY: KvReplay,
    MsgType.OUTPUTS: Outputs,
    MsgType.RESERVED: Reserved,
    MsgType.OTHERS: Others,
}
_TYPE_OF = {cls: t for t, cls in _TYPES.items()}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[MsgType, msgspec.msgpack.Decoder[Any]] = {
    t: msgspec.msgpack.Decoder(cls) for t, cls in _TYPES.items()}

Message = (Register | RegisterAck | Heartbeat | Drain | Unregister | Generate | Abort | Output
           | Outputs | Ping | Leave | KvEvents | KvReplay | Reserved | Others)


def encode(msg: _Msg) -> list[bytes]:
    return [bytes((PROTOCOL_VERSION, _TYPE_OF[type(msg)])), _ENCODER.encode(msg)]


def decode(frames: list[bytes]) -> Message:
    """Decode the two frames of a message; raise ProtocolError for anything malformed."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    header, body = frames
    if len(header) != 2:
        raise ProtocolError(f"bad header of {len(header)} bytes")
    version, mtype = header[0], header[1]
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version)
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        decoder = _DECODERS[MsgType(mtype)]
    except ValueError:
        raise ProtocolError(f"unknown message type {mtype}") from None
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"bad {MsgType(mtype).name} body: {e}") from None


def peek_version(frames: list[bytes]) -> int | None:
    return frames[0][0] if frames and len(frames[0]) == 2 else None
