"""Connections as a resource: 100+ half-open TCP connections (connect, never handshake) and a
slowloris stream (a frame trickled byte by byte) from one address, against a libp2p host, the
direct chunk port, and a real learner process with an honest node. Connections past the per-address
cap are closed at once, the rest by the handshake deadline; an honest peer from another address
still connects, joins and contributes."""

from __future__ import annotations

import json
import struct
import time

import trio
from libp2p.peer.id import ID

from echorl.broadcast.chunk_server import ChunkServer
from echorl.net.guard import ConnectionLimits
from echorl.net.host import HostConfig, open_host
from echorl.net.transport import UploadLimiter
from echorl.protocol import routes
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Status, StatusRequest

ATTACKER_IP = "127.0.0.2"  # still loopback: the attacker's address differs from the honest peers'


async def half_open(port: int, n: int, results: list[float], hold_s: float) -> None:
    """``n`` TCP connections from ``ATTACKER_IP`` that send nothing; each records how long the
    server kept it open (``hold_s`` if it was still open then)."""

    async def one() -> None:
        sock = trio.socket.socket()
        await sock.bind((ATTACKER_IP, 0))
        t0 = time.monotonic()
        try:
            await sock.connect(("127.0.0.1", port))
            stream = trio.SocketStream(sock)
            with trio.move_on_after(hold_s):
                while await stream.receive_some(4096):
                    pass  # a server may write its handshake: the attacker never answers
            results.append(time.monotonic() - t0)
        except (OSError, trio.BrokenResourceError):
            results.append(time.monotonic() - t0)
        finally:
            sock.close()

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)


def _port(addr: str) -> int:
    return int(addr.split("/tcp/")[1].split("/")[0])


def test_half_open_and_slowloris_connections_are_capped_and_closed_by_deadline() -> None:
    async def main() -> None:
        cfg = HostConfig(
            handshake_timeout_s=1.0, io_timeout_s=1.0, connection_limits=ConnectionLimits(max_total=64, max_per_ip=8)
        )
        async with open_host(Identity.generate(), cfg) as server, open_host(Identity.generate()) as honest:

            async def status(msg, ctx):
                return Status(run_id="r", learner={}, peers=[], total_peers=0)

            server.serve({routes.STATUS: status})
            held: list[float] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(half_open, _port(server.addrs[0]), 120, held, 10.0)
                await trio.sleep(0.5)
                assert server.guard.per_ip.get(ATTACKER_IP) == 8  # the cap, not 120
                with trio.fail_after(5):  # another address still gets in and is served
                    await honest.connect(server.addrs[0])
                    assert isinstance(await honest.request(server.peer_id, routes.STATUS, StatusRequest()), Status)
            assert len(held) == 120 and server.guard.refused >= 112
            assert sorted(held)[-8] < 4.0 and max(held) < 4.0  # the 8 admitted: closed by the 1 s deadline
            with trio.fail_after(3):  # every slot given back once the server closed its side
                while ATTACKER_IP in server.guard.per_ip:
                    await trio.sleep(0.05)

            # slowloris: a joined-looking peer opens a stream and trickles a frame; the frame
            # deadline resets it, the host keeps serving
            stream = await honest.libp2p.new_stream(ID.from_base58(server.peer_id), [routes.STATUS])
            t0 = time.monotonic()
            closed = False
            with trio.move_on_after(8):
                try:
                    for b in struct.pack(">I", 1000) + b"\x81" * 50:
                        await stream.write(bytes([b]))
                        await trio.sleep(0.3)
                except Exception:
                    closed = True
            assert closed and time.monotonic() - t0 < 6.0
            assert server.stats.truncated >= 1
            assert isinstance(await honest.request(server.peer_id, routes.STATUS, StatusRequest()), Status)

    trio.run(main)


def test_direct_chunk_port_caps_half_open_connections() -> None:
    async def main() -> None:
        cfg = HostConfig(handshake_timeout_s=1.0, connection_limits=ConnectionLimits(max_total=64, max_per_ip=8))
        async with open_host(Identity.generate(), cfg) as host:
            server = ChunkServer(host, "r", UploadLimiter(None))
            async with trio.open_nursery() as nursery:
                port = await nursery.start(server.serve_direct)
                held: list[float] = []
                await half_open(port, 100, held, 10.0)
                nursery.cancel_scope.cancel()
            assert len(held) == 100 and server.direct_guard.refused >= 92 and max(held) < 4.0
            assert server.direct_guard.total == 0

    trio.run(main)


CONFIG = {
    "prompts_per_step": 4,
    "prompts_per_lease": 2,
    "group_size": 2,
    "staleness": 2,
    "eval_every": 100000,
    "steps": 0,
    "spot_check_fraction": 0.0,
    "checkpoint_dir": "none",
}


def test_honest_node_joins_a_learner_under_a_half_open_flood(swarm, tmp_path) -> None:
    cfg = tmp_path / "learner.json"
    cfg.write_text(json.dumps(CONFIG))
    addr = swarm.start_learner("--config", str(cfg))
    held: list[float] = []

    async def attack_then_node() -> None:
        async with trio.open_nursery() as nursery:

            async def waves() -> None:  # 110 at a time (the listen backlog is 128): the attacker
                while True:  # re-opens what the learner closed until the node has contributed
                    await half_open(_port(addr), 110, held, 30.0)

            nursery.start_soon(waves)
            await trio.sleep(1.0)
            swarm.start_node("honest")
            await trio.to_thread.run_sync(
                lambda: swarm.wait_for(
                    lambda: any(r.get("step", 0) >= 2 for r in swarm.metrics()), timeout=240, what="2 steps"
                )
            )
            while len(held) < 110:  # at least one whole wave, however fast the node got in
                await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    trio.run(attack_then_node)
    assert len(held) >= 110
    assert max(held) < 15.0  # every attacking connection was closed (5 s deadline), none held 30 s
    rows = swarm.metrics()
    assert rows[-1]["connections_refused"] >= 110 - 48
    st = swarm.status()
    assert any(p["groups_accepted"] > 0 for p in st["peers"])


CLIENT = """
import sys, trio
from echorl.net.host import open_host
from echorl.protocol.identity import Identity

async def main():
    async with open_host(Identity.generate()) as h:
        with trio.fail_after(10):
            await h.connect(sys.argv[1])
        await trio.sleep(0.5)

trio.run(main)
"""


def test_closed_connections_give_their_slot_back() -> None:
    """py-libp2p parks its inbound handler for the swarm's lifetime: the guard must still free a
    connection's slot once it is closed, or an address could connect only ``max_per_ip`` times.
    (Clients are processes: a py-libp2p host that exits inside a process leaves its sockets open.)"""
    import sys

    from swarm import ENV

    async def main() -> None:
        cfg = HostConfig(connection_limits=ConnectionLimits(max_total=64, max_per_ip=3))
        async with open_host(Identity.generate(), cfg) as server:
            for _ in range(2):  # 2 rounds of 3 peers: the second gets in only if the first gave its slots back
                async with trio.open_nursery() as nursery:
                    for _ in range(3):
                        nursery.start_soon(
                            lambda: trio.run_process([sys.executable, "-c", CLIENT, server.addrs[0]], env=ENV)
                        )
                with trio.fail_after(10):
                    while server.guard.total:
                        await trio.sleep(0.1)
            assert server.guard.refused == 0 and not server.guard.per_ip

    trio.run(main)
