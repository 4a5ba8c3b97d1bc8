"""Learner-side membership rules: dial-back reachability, one live process per key, run end."""

import socket
import time
from types import SimpleNamespace

import pytest
import trio

from echorl.learner.membership import RunEnd, check_identity, dial_back
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
    peers, instances = {}, {}
    check_identity(peers, instances, _join(b"a" * 16), "P", window_s=12)
    peers["P"] = SimpleNamespace(alive=True, last_seen=time.monotonic())
    check_identity(peers, instances, _join(b"a" * 16), "P", window_s=12)  # the same process re-joins
    with pytest.raises(ProtocolError) as err:
        check_identity(peers, instances, _join(b"b" * 16), "P", window_s=12)
    assert err.value.code == ErrorCode.IDENTITY_IN_USE
    assert instances["P"] == b"a" * 16  # the refusal changed nothing
    peers["P"].last_seen -= 30  # the first process went quiet: a restart is welcome
    check_identity(peers, instances, _join(b"b" * 16), "P", window_s=12)
    assert instances["P"] == b"b" * 16


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
