"""A node checks the sender before it reads a body (issue 24, findings 4 and 6): announcements
only from the pinned learner and its plan parents, chunk streams, tickets, chunk and catch-up
requests only from the learner and the members of a plan it holds; a refused body is never
read, a peer refused again and again is struck off, and what one address may pull from a node
outside the plan streams is paced per address, whatever identities it uses."""

from __future__ import annotations

import struct
import time

import numpy as np
import trio
from libp2p.peer.id import ID
from plans import share_a_plan
from swarm import safetensors_f32

from echorl.broadcast.chunk_server import ChunkServer
from echorl.broadcast.relay import Relay
from echorl.net.framing import read_frame
from echorl.net.host import RemoteError, open_host
from echorl.net.ratelimit import RateLimit
from echorl.net.transport import UploadLimiter
from echorl.protocol import snapshot, wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import CatchUpRequest, ChunkRequest, Subscribe
from echorl.protocol.routes import ANNOUNCE, CATCHUP, CHUNK, STREAM, TICKET

ANNOUNCED = 16 * 1024 * 1024  # the largest frame a node's ANNOUNCE route takes


async def _refused_unread(stranger, node: str, route: str, announced: int = ANNOUNCED) -> str:
    """Open ``route`` and write a header announcing a body of ``announced`` bytes (within the
    route's cap), then only 64 bytes of it: a peer that reads first waits out its I/O timeout and
    answers nothing; one that checks the sender first answers at once."""
    stream = await stranger.libp2p.new_stream(ID.from_base58(node), [route])
    try:
        await stream.write(struct.pack(">I", announced) + b"\x00" * 64)
        with trio.fail_after(5):
            body = await read_frame(stream, max_bytes=1 << 16, first_byte_timeout=5, io_timeout=5)
        return wire.decode(body).code
    finally:
        await stream.reset()


def test_a_stranger_s_announce_is_refused_unread_and_repeated_refusals_strike_it() -> None:
    async def main() -> None:
        learner = Identity.generate()
        async with open_host(Identity.generate()) as node, open_host(Identity.generate()) as stranger:
            relay = Relay(node, learner.peer_id, "r")
            relay.install()
            await stranger.connect(node.addrs[0])
            assert await _refused_unread(stranger, node.peer_id, ANNOUNCE) == "not_found"
            assert node.stats.refused["not_found"] == 1 and node.stats.truncated == 0
            for _ in range(node.strikes.limit - 1):
                try:
                    await _refused_unread(stranger, node.peer_id, ANNOUNCE)
                except Exception:
                    break
            assert node.strikes.struck == 1 and node.strikes.banned(stranger.peer_id, trio.current_time())

    trio.run(main)


def test_a_node_serves_weights_to_the_learner_and_plan_members_only() -> None:
    """A stranger gets nothing from a node that holds a version (chunk, catch-up, ticket, chunk
    stream); a member of a plan the node holds gets the chunk."""

    async def main() -> None:
        learner = Identity.generate()
        data = safetensors_f32(np.arange(4096, dtype=np.float32))
        manifest, _ = snapshot.build_manifest(learner, "r", 3, -1, data, data, chunk_bytes=4096)
        async with (
            open_host(Identity.generate()) as node,
            open_host(Identity.generate()) as stranger,
            open_host(Identity.generate()) as member,
        ):
            relay = Relay(node, learner.peer_id, "r")
            relay.server.announce_wait_s = 1.0  # how long a plan edge's route waits for a plan that admits
            relay.install()
            assert await relay.adopt(3, data, manifest)
            share_a_plan(relay, learner, member.peer_id)
            digest = manifest.chunks[0].digest
            for peer in (stranger, member):
                await peer.connect(node.addrs[0])
            asks = [
                (CHUNK, ChunkRequest(digest=digest)),
                (CATCHUP, CatchUpRequest(run_id="r", have_version=-1)),
                (TICKET, Subscribe(run_id="r", version=3, stripe=0)),
            ]
            for route, msg in asks:
                try:
                    await stranger.request(node.peer_id, route, msg, timeout=5)
                    raise AssertionError(f"{route} served a stranger")
                except RemoteError as exc:
                    assert exc.code.value == "not_found", (route, exc)
            assert await _refused_unread(stranger, node.peer_id, STREAM, 512) == "not_found"
            reply = await member.request(node.peer_id, CHUNK, ChunkRequest(digest=digest), timeout=5)
            assert reply.data == data[: manifest.chunks[0].size]

    trio.run(main)


def test_a_child_that_subscribes_before_its_parent_has_the_plan_is_admitted_when_it_arrives() -> None:
    """The learner announces to every member at once: a child may ask its parent for a ticket a
    moment before the parent holds the plan naming it; the parent waits for that plan (bounded)
    rather than refusing an honest child (and being reported as a stalled parent)."""

    async def main() -> None:
        learner = Identity.generate()
        async with open_host(Identity.generate()) as parent, open_host(Identity.generate()) as child:
            relay = Relay(parent, learner.peer_id, "r")
            relay.install()
            await child.connect(parent.addrs[0])

            async def plan_arrives() -> None:
                await trio.sleep(0.5)
                share_a_plan(relay, learner, child.peer_id)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(plan_arrives)
                sub = Subscribe(run_id="r", version=10**6, stripe=0)
                try:
                    await child.request(parent.peer_id, TICKET, sub, timeout=10)
                    raise AssertionError("a ticket without a direct port")
                except RemoteError as exc:  # admitted: the handler answers (no direct port: relay.run not started)
                    assert exc.code.value in ("unavailable", "not_found") and "admitted" not in exc.detail, exc

    trio.run(main)


def test_node_chunk_serving_is_paced_per_address_not_per_identity() -> None:
    """Two identities from one address share one download bucket."""

    async def main() -> None:
        learner = Identity.generate()
        data = safetensors_f32(np.random.default_rng(0).standard_normal(64 * 1024).astype(np.float32))
        manifest, _ = snapshot.build_manifest(learner, "r", 1, -1, data, data, chunk_bytes=64 * 1024)
        async with (
            open_host(Identity.generate()) as node,
            open_host(Identity.generate()) as a,
            open_host(Identity.generate()) as b,
        ):
            rate = 256 * 1024.0
            server = ChunkServer(
                node,
                "r",
                UploadLimiter(None),
                admit=lambda peer: True,
                fetch_limit=RateLimit(rate, 64 * 1024),
                fetch_per_address=True,
            )
            server.install_serving()
            path = server.store.new_path(1)
            await trio.to_thread.run_sync(path.write_bytes, data)
            server.chain.hold(manifest, path)
            chunks = [c.digest for c in manifest.chunks][:4]
            for peer in (a, b):
                await peer.connect(node.addrs[0])
            t0 = time.monotonic()
            async with trio.open_nursery() as nursery:
                for peer, digests in ((a, chunks[:2]), (b, chunks[2:])):
                    for d in digests:
                        nursery.start_soon(peer.request, node.peer_id, CHUNK, ChunkRequest(digest=d))
            # 4 chunks of 64 KiB, the first within the burst: 3 × 64 KiB at 256 KiB/s, shared
            assert time.monotonic() - t0 >= 0.7

    trio.run(main)


def test_the_learner_reads_broadcast_reports_only_from_plan_members() -> None:
    """A ``BroadcastDone`` (16 KiB) from a peer in no plan in flight is refused unread."""
    from echorl.broadcast.broadcaster import Broadcaster
    from echorl.protocol.routes import DONE

    async def main() -> None:
        li = Identity.generate()
        async with open_host(li) as lh, open_host(Identity.generate()) as stranger:
            bc = Broadcaster(lh, li, "r", direct=False)
            bc.install()
            await bc.publish(0, safetensors_f32(np.zeros(256, dtype=np.float32)), [])
            await stranger.connect(lh.addrs[0])
            assert await _refused_unread(stranger, li.peer_id, DONE, 8 * 1024) == "not_found"
            assert lh.stats.refused["not_found"] == 1 and lh.stats.truncated == 0

    trio.run(main)
