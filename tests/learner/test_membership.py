"""Learner-side membership rules: dial-back reachability, one live process per key, run end."""

import socket
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import trio
from swarm import capability

from echorl.learner.membership import RunEnd, check_identity
from echorl.learner.peers import PeerBook
from echorl.net.dialback import dial_back
from echorl.net.host import open_host
from echorl.protocol import wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity


def test_dial_back_needs_a_libp2p_listener_on_the_connections_ip():
    async def main():
        async with open_host(Identity.generate()) as node:
            addr = node.addrs[0]
            assert await dial_back([addr], "127.0.0.1")
            assert not await dial_back([addr], "198.18.0.9")  # not where the node connects from
            assert not await dial_back([], "127.0.0.1")
            with socket.socket() as plain:  # listens, but does not speak libp2p
                plain.bind(("127.0.0.1", 0))
                plain.listen()
                port = plain.getsockname()[1]
                t0 = time.monotonic()
                assert not await dial_back([f"/ip4/127.0.0.1/tcp/{port}"], "127.0.0.1", timeout_s=1.0)
                assert time.monotonic() - t0 < 3
            with socket.socket() as closed:
                closed.bind(("127.0.0.1", 0))
                assert not await dial_back([f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}"], "127.0.0.1")
            assert await dial_back(["garbage", f"/ip4/127.0.0.1/tcp/1/p2p/{node.peer_id}", addr], "127.0.0.1")

    trio.run(main)


def _join(instance: bytes):
    return SimpleNamespace(instance=instance)


def test_second_live_process_with_one_key_is_refused():
    """The peer book's record names the member's process; a join from another process while it
    is live is refused and changes nothing; once it went quiet, a restart is welcome."""
    book = PeerBook()
    cap = capability(reachable=False)
    check_identity(book, _join(b"a" * 16), "P", window_s=12)
    book.join("P", cap, 0, instance=b"a" * 16)
    check_identity(book, _join(b"a" * 16), "P", window_s=12)  # the same process re-joins
    with pytest.raises(ProtocolError) as err:
        check_identity(book, _join(b"b" * 16), "P", window_s=12)
    assert err.value.code == ErrorCode.IDENTITY_IN_USE
    assert book["P"].instance == b"a" * 16  # the refusal changed nothing
    book.add(replace(book["P"], last_seen=time.monotonic() - 30))  # the first process went quiet
    check_identity(book, _join(b"b" * 16), "P", window_s=12)  # a restart is welcome
    book.join("P", cap, 0, instance=b"b" * 16)
    assert book["P"].instance == b"b" * 16


def test_run_end_is_signed_per_node_and_waits_for_live_nodes():
    learner = Identity.generate()
    end = RunEnd(learner, "run-1")

    async def main():
        live = ["A", "B"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(end.announce, 9, 9, lambda: live, 5.0)
            await trio.sleep(0.2)
            msg = end.reply("A", SimpleNamespace(leases_done=3, groups_accepted=24))
            wire.verify(msg, expected_signer=learner.peer_id)
            assert (msg.version, msg.leases_done, msg.groups_accepted) == (9, 3, 24)
            end.reply("B", SimpleNamespace(leases_done=0, groups_accepted=0))
        return time.monotonic()

    t0 = time.monotonic()
    assert trio.run(main) - t0 < 3  # returned once both were told, not after the 5 s grace
    assert end.told == {"A", "B"}


def test_a_doctors_probe_reads_weights_for_a_while_is_no_node_and_is_bounded(monkeypatch):
    from echorl.learner import membership
    from echorl.protocol.messages import PROBE_ENGINE

    members = membership.Members(Identity.generate(), "r")
    probe = lambda engine: SimpleNamespace(capability=SimpleNamespace(engine=engine))
    assert members.probe(probe("torch"), "node") is False and not members.probing("node")  # a node joins as one
    now = [1000.0]
    monkeypatch.setattr(membership.time, "monotonic", lambda: now[0])
    for i in range(membership.MAX_PROBES):
        assert members.probe(probe(PROBE_ENGINE), f"doctor{i}") and members.probing(f"doctor{i}")
    with pytest.raises(ProtocolError) as refused:
        members.probe(probe(PROBE_ENGINE), "one-too-many")
    assert refused.value.code == ErrorCode.UNAVAILABLE
    assert members.probe(probe(PROBE_ENGINE), "doctor0")  # a probe that asks again keeps its place
    now[0] += membership.PROBE_TTL_S + 1
    assert not members.probing("doctor0")  # its leave to read weights ran out
    assert members.probe(probe(PROBE_ENGINE), "one-too-many")  # and the expired ones made room
