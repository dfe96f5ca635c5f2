"""A decode engine's notices to prefill engines (pdserve/kv/notices.py), over a fake NIXL agent:
a read goes out without its notice, which is sent once the read is seen done, with the notices
vLLM sends on their own, and then a one-byte read with no notice flushes each peer sent one."""

from __future__ import annotations

import pytest

from pdserve.kv import notices
from pdserve.kv.notices import HeldNotices


class FakeAgent:
    """The NIXL agent calls vLLM's reader makes: transfer and check_xfer_state answer from a
    script per handle (its last state repeating)."""

    def __init__(self):
        self.registered: list = []
        self.sent: list[tuple[str, bytes]] = []  # notices
        self.reads: list[tuple] = []  # (peer, notice) of each read made
        self.posted: list = []
        self.released: list = []
        self.removed: list[str] = []
        self.states: dict = {}
        self.fail_initialize = False

    def register_memory(self, regions, mem_type):
        self.registered.append(regions)

    def get_xfer_descs(self, descs, mem_type):
        return ("descs", tuple(descs))

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=()):
        return ("dlist", agent_name)

    def make_prepped_xfer(self, operation, local, local_ids, remote, remote_ids, notif_msg=b""):
        handle = ("read", len(self.reads))
        self.reads.append((remote[1], notif_msg))
        return handle

    def initialize_xfer(self, operation, local, remote, agent):
        if self.fail_initialize:
            raise RuntimeError("no such agent")
        handle = ("byte", agent, remote)
        self.reads.append((agent, b""))
        return handle

    def transfer(self, handle):
        self.posted.append(handle)
        return self._next(handle)

    def check_xfer_state(self, handle):
        return self._next(handle)

    def _next(self, handle):
        script = self.states.setdefault(handle, ["DONE"])
        return script.pop(0) if len(script) > 1 else script[0]

    def release_xfer_handle(self, handle):
        self.released.append(handle)

    def send_notif(self, remote_agent_name, notif_msg):
        self.sent.append((remote_agent_name, notif_msg))

    def remove_remote_agent(self, agent):
        self.removed.append(agent)

    def get_new_notifs(self):
        return {"P": [b"x"]}


@pytest.fixture
def agent():
    return FakeAgent()


def read(held: HeldNotices, peer: str = "P", notice: bytes = b"req-1:1"):
    """A read as vLLM's reader makes one: its peer's descriptors prepared first (once)."""
    remote = held.prep_xfer_dlist(peer, [(0x1000, 64, 0), (0x2000, 64, 0)])
    handle = held.make_prepped_xfer("READ", "local", [0], remote, [0], notif_msg=notice)
    held.transfer(handle)
    return handle


def test_a_read_goes_out_without_its_notice_which_is_sent_once_the_read_is_seen_done(agent):
    held = HeldNotices(agent)
    agent.states[("read", 0)] = ["PROC", "DONE"]
    handle = read(held)
    assert agent.reads == [("P", b"")]
    held.send()
    assert agent.sent == []  # in flight: NIXL too would notify only once it is done
    assert held.check_xfer_state(handle) == "DONE"
    held.send()
    assert agent.sent == [("P", b"req-1:1")]
    held.send()
    assert agent.sent == [("P", b"req-1:1")]  # once


def test_after_the_notices_a_one_byte_read_with_none_flushes_each_peer_sent_one(agent):
    held = HeldNotices(agent)
    for peer in ("P", "P", "Q"):
        read(held, peer)  # each done as posted
    held.send()
    flushes = [h for h in agent.posted if h[0] == "byte"]
    assert [(peer, remote[1][0][:2]) for _, peer, remote in flushes] == [("P", (0x1000, 1)),
                                                                          ("Q", (0x1000, 1))]
    assert agent.reads[-2:] == [("P", b""), ("Q", b"")]  # no notice on them
    assert len(agent.registered) == 1 and agent.registered[0][0][1] == 1  # one byte, once


def test_vllms_own_notices_wait_for_the_steps_reads_too(agent):
    held = HeldNotices(agent)
    held.prep_xfer_dlist("P", [(0x1000, 64, 0)])
    held.send_notif("P", notif_msg=b"HB:req-1")
    assert agent.sent == []
    held.send()
    assert agent.sent == [("P", b"HB:req-1")]
    assert [h[1] for h in agent.posted if h[0] == "byte"] == ["P"]


@pytest.mark.parametrize("end", ["ERR", "released"])
def test_a_read_that_fails_or_is_released_unfinished_sends_no_notice(agent, end):
    held = HeldNotices(agent)
    agent.states[("read", 0)] = ["PROC", "ERR"]
    handle = read(held)
    if end == "ERR":
        assert held.check_xfer_state(handle) == "ERR"
    else:
        held.release_xfer_handle(handle)
        assert agent.released == [handle]
    held.send()
    assert agent.sent == [] and not [h for h in agent.posted if h[0] == "byte"]


def test_a_read_of_descriptors_prepared_unseen_keeps_its_notice_with_it(agent):
    held = HeldNotices(agent)
    handle = held.make_prepped_xfer("READ", "local", [0], ("dlist", "P"), [0], notif_msg=b"n")
    held.transfer(handle)
    held.send()
    assert agent.reads == [("P", b"n")] and agent.sent == []


def test_a_flush_in_flight_is_posted_again_once_done_if_the_peer_was_noticed_meanwhile(agent):
    held = HeldNotices(agent)
    flush = ("byte", "P", ("descs", ((0x1000, 1, 0),)))
    agent.states[flush] = ["PROC", "PROC", "DONE"]
    read(held)
    held.send()  # the flush goes out, and moves
    read(held, notice=b"req-2:1")
    held.send()  # still moving: owed
    assert agent.posted.count(flush) == 1
    held.send()  # done now: posted again
    assert agent.posted.count(flush) == 2


def test_a_failed_flush_is_forgotten_and_a_peer_agent_unknown_has_none(agent):
    held = HeldNotices(agent)
    flush = ("byte", "P", ("descs", ((0x1000, 1, 0),)))
    agent.states[flush] = ["PROC", "ERR"]
    read(held)
    held.send()
    held.send()
    assert agent.released == [flush]
    agent.fail_initialize = True
    read(held, "Q")
    held.send()  # no flush for Q, and no error: its own reads say what is wrong
    assert agent.sent[-1] == ("Q", b"req-1:1")


def test_a_removed_peer_gets_no_notice_nor_flush_and_its_flush_is_released(agent):
    held = HeldNotices(agent)
    flush = ("byte", "P", ("descs", ((0x1000, 1, 0),)))
    agent.states[flush] = ["PROC"]
    read(held)
    held.send()
    read(held, notice=b"req-2:1")
    held.remove_remote_agent("P")
    held.send()
    assert agent.removed == ["P"] and agent.released == [flush]
    assert agent.sent == [("P", b"req-1:1")]


def test_anything_else_goes_to_the_agent(agent):
    assert HeldNotices(agent).get_new_notifs() == {"P": [b"x"]}


def test_a_failed_notice_is_logged_not_raised(agent, monkeypatch, caplog):
    held = HeldNotices(agent)

    def refuse(*a, **k):
        raise RuntimeError("gone")

    monkeypatch.setattr(agent, "send_notif", refuse)
    read(held)
    with caplog.at_level("WARNING", logger=notices.logger.name):
        held.send()
    assert "freed when their lease ends" in caplog.text
