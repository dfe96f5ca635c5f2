"""The wire codec: every message round-trips; anything malformed is a ProtocolError."""

from __future__ import annotations

import random

import msgspec
import pytest

from pdserve import protocol
from pdserve.protocol import (
    EngineInfo,
    ErrorKind,
    Load,
    MsgType,
    Phase,
    ProtocolError,
    Role,
    SeqDelta,
    TokenLogprob,
    VersionMismatch,
)

INFO = EngineInfo("m", "tok", 16, "float32", "nixl", 4096)

MESSAGES = [
    protocol.Register("w1", Role.BOTH, "10.0.0.2", INFO, kv_port=5600, pid=42, kv_events=True,
                      kv_blocks=4096, kv_block_bytes=65536, max_seqs=128, reserves=True),
    protocol.RegisterAck(False, "model: no", "c1", 0.25, reregister=True, dead_after=30.0,
                         siblings=[8002, 8003], reserves=True),
    protocol.Heartbeat("w1", Load(3, 4, 0.75, others=2), draining=True),
    protocol.Drain("w1"),
    protocol.Unregister("w1", "drained"),
    protocol.Generate("r1-0-p1", Phase.DECODE, [1, 2, 3],
                      msgspec.Raw(msgspec.msgpack.encode({"max_tokens": 5})),
                      {"do_remote_prefill": True, "remote_block_ids": [0, 1]}),
    protocol.Abort(["a", "b"]),
    protocol.Ping("c1"),
    protocol.Leave("c1", "shutting down"),
    protocol.KvEvents("w1", 7, msgspec.Raw(msgspec.msgpack.encode([1.5, [], None]))),
    protocol.KvReplay(3),
    protocol.Reserved(12),
    protocol.Others("w1", 40),
    protocol.Output("r1", [SeqDelta(1, " x", [5, 6], [[TokenLogprob(5, -0.5, 1, " x")],
                                                      [TokenLogprob(6, -1.0, None, None)]],
                                    -1.5, "stop", 6)],
                    finished=True, num_cached_tokens=32, kv_transfer_params={"k": 1},
                    prompt_logprobs=[None, [TokenLogprob(2, -0.1)]], error="boom",
                    error_kind=ErrorKind.ENGINE),
    protocol.Outputs([protocol.Output("r1", [SeqDelta(0, " a", [7])]),
                      protocol.Output("r2", [], finished=True, error="gone",
                                      error_kind=ErrorKind.DEAD)]),
]


def test_every_message_type_is_covered():
    assert {type(m) for m in MESSAGES} == set(protocol._TYPES.values())
    assert len(MsgType) == len(MESSAGES)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = protocol.encode(msg)
    assert len(frames) == 2 and frames[0] == bytes((protocol.PROTOCOL_VERSION,
                                                    protocol._TYPE_OF[type(msg)]))
    back = protocol.decode(frames)
    assert type(back) is type(msg)
    if isinstance(msg, protocol.Generate):  # Raw compares by identity: compare its bytes
        assert bytes(back.sampling_params) == bytes(msg.sampling_params)
        back = msgspec.structs.replace(back, sampling_params=msg.sampling_params)
    assert back == msg


def test_defaults_round_trip_without_field_names():
    msg = protocol.Output("r", [])
    frames = protocol.encode(msg)
    assert protocol.decode(frames) == msg
    assert b"request_id" not in frames[1]  # array-like: field names do not travel


def test_version_mismatch_names_both_versions():
    frames = protocol.encode(MESSAGES[0])
    with pytest.raises(VersionMismatch) as e:
        protocol.decode([bytes((7, frames[0][1])), frames[1]])
    assert "v7" in str(e.value) and f"v{protocol.PROTOCOL_VERSION}" in str(e.value)
    assert e.value.theirs == 7 and isinstance(e.value, ProtocolError)
    assert protocol.peek_version([bytes((7, 1)), b""]) == 7


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_truncation_is_a_protocol_error(msg):
    header, body = protocol.encode(msg)
    for cut in range(len(body)):
        with pytest.raises(ProtocolError):
            protocol.decode([header, body[:cut]])


@pytest.mark.parametrize("frames, words", [
    ([b"\x01\x01"], "2 frames"),
    ([b"\x01\x01", b"", b""], "2 frames"),
    ([b"\x01", b"\x90"], "header"),
    ([b"\x01\x01\x01", b"\x90"], "header"),
    ([bytes((protocol.PROTOCOL_VERSION, 99)), b"\x90"], "unknown message type 99"),
    ([bytes((protocol.PROTOCOL_VERSION, 0)), b"\x90"], "unknown message type 0"),
    ([bytes((protocol.PROTOCOL_VERSION, MsgType.DRAIN)), b"\x92\x01\x02"], "DRAIN"),
])
def test_malformed_frames(frames, words):
    with pytest.raises(ProtocolError) as e:
        protocol.decode(frames)
    assert words in str(e.value)


def test_oversized_body(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 100)
    header, _ = protocol.encode(MESSAGES[6])
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode([header, protocol._ENCODER.encode(protocol.Abort(["x" * 200]))])


def test_wrong_body_type_is_refused():
    # A well-formed Drain body sent under the Register type.
    _, body = protocol.encode(protocol.Drain("w1"))
    with pytest.raises(ProtocolError, match="REGISTER"):
        protocol.decode([bytes((protocol.PROTOCOL_VERSION, MsgType.REGISTER)), body])
    # An enum value that does not exist.
    bad = protocol.Heartbeat("w1", Load())
    header, body = protocol.encode(protocol.Register("w", Role.DECODE, "a", INFO))
    with pytest.raises(ProtocolError):
        protocol.decode([header, body.replace(bytes([Role.DECODE]), b"\x09", 1)])
    assert protocol.decode(protocol.encode(bad)) == bad


def test_random_and_mutated_frames_only_ever_raise_protocol_error():
    rng = random.Random(3)
    valid = [protocol.encode(m) for m in MESSAGES]
    for _ in range(3000):
        header, body = rng.choice(valid)
        if rng.random() < 0.5:
            body = bytearray(body)
            for _ in range(rng.randint(1, 5)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            body = bytes(body)
        else:
            body = rng.randbytes(rng.randrange(40))
        try:
            protocol.decode([header, body])
        except ProtocolError:
            pass


def test_roles():
    assert Role.PREFILL.serves(Role.PREFILL) and not Role.PREFILL.serves(Role.DECODE)
    assert Role.DECODE.serves(Role.DECODE) and not Role.DECODE.serves(Role.PREFILL)
    assert Role.BOTH.serves(Role.PREFILL) and Role.BOTH.serves(Role.DECODE)
    assert Role.AUTO.serves(Role.PREFILL) and Role.AUTO.serves(Role.DECODE)  # its engine can
    assert [r.label for r in Role] == ["prefill", "decode", "both", "auto"]


def test_engine_info_mismatches_name_the_field_and_both_values():
    other = msgspec.structs.replace(INFO, block_size=32, dtype="bfloat16")
    wrong = INFO.mismatches(other)
    assert len(wrong) == 2
    assert wrong[0] == "block_size: worker has 32, controller expects 16"
    assert "dtype" in wrong[1] and "'bfloat16'" in wrong[1] and "'float32'" in wrong[1]
    assert INFO.mismatches(INFO) == []


def test_a_field_added_at_the_end_is_ignored_by_a_peer_that_predates_it():
    class OldAck(msgspec.Struct, array_like=True, omit_defaults=True):
        accepted: bool
        reason: str = ""
        controller_id: str = ""
        heartbeat_interval: float = 1.0
        reregister: bool = False
        dead_after: float = 0.0

    frames = protocol.encode(protocol.RegisterAck(True, "", "c1", 0.5, siblings=[8002]))
    old = msgspec.msgpack.decode(frames[1], type=OldAck)
    assert (old.accepted, old.controller_id, old.heartbeat_interval) == (True, "c1", 0.5)
