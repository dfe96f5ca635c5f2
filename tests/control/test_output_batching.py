"""A worker sends the outputs made in one turn of its event loop as one message, and never lets
a later control message overtake them."""

from __future__ import annotations

import asyncio
import logging

import zmq

from pdserve import protocol
from pdserve.protocol import Output, SeqDelta
from pdserve.worker.worker import MAX_BATCH, _Link


class Sock:
    """Records what a link sends, as decoded messages."""

    def __init__(self, full: bool = False):
        self.sent: list[protocol.Message] = []
        self.full = full

    def send_multipart(self, frames, flags=0, copy=True):
        if self.full:
            raise zmq.Again()
        self.sent.append(protocol.decode([bytes(f) for f in frames]))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def out(rid: str, tok: int = 1) -> Output:
    return Output(rid, [SeqDelta(0, f" {tok}", [tok])])


async def test_outputs_of_one_turn_travel_as_one_message():
    link = _Link("tcp://c:1", Sock())  # type: ignore[arg-type]
    for rid in ("a", "b", "c"):
        link.queue(out(rid))
    assert link.sock.sent == []  # nothing before the turn ends
    await asyncio.sleep(0)
    [msg] = link.sock.sent
    assert isinstance(msg, protocol.Outputs) and [o.request_id for o in msg.outputs] == ["a", "b", "c"]


async def test_a_lone_output_travels_as_itself_and_turns_are_not_merged():
    link = _Link("tcp://c:1", Sock())  # type: ignore[arg-type]
    link.queue(out("a", 1))
    await asyncio.sleep(0)
    link.queue(out("a", 2))
    await asyncio.sleep(0)
    assert [type(m) for m in link.sock.sent] == [Output, Output]
    assert [m.seqs[0].token_ids for m in link.sock.sent] == [[1], [2]]


async def test_a_control_message_goes_after_the_outputs_made_before_it():
    link = _Link("tcp://c:1", Sock())  # type: ignore[arg-type]
    link.queue(out("a"))
    link.queue(out("b"))
    link.send(protocol.Unregister("w1", "bye"))
    await asyncio.sleep(0)  # the scheduled flush finds nothing left
    assert [type(m) for m in link.sock.sent] == [protocol.Outputs, protocol.Unregister]


async def test_a_message_is_bounded():
    link = _Link("tcp://c:1", Sock())  # type: ignore[arg-type]
    for i in range(MAX_BATCH + 3):
        link.queue(out(f"r{i}"))
    link.queue(Output("big", [], prompt_logprobs=[None]))
    await asyncio.sleep(0)
    sizes = [len(m.outputs) if isinstance(m, protocol.Outputs) else 1 for m in link.sock.sent]
    assert sizes == [MAX_BATCH, 4]
    assert sum(sizes) == MAX_BATCH + 4


async def test_an_unreachable_controller_drops_the_batch_without_raising(caplog):
    link = _Link("tcp://c:1", Sock(full=True))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="pdserve.worker"):
        link.queue(out("a"))
        link.queue(out("b"))
        await asyncio.sleep(0)
    assert link.pending == [] and "dropped the outputs of a, b" in caplog.text
