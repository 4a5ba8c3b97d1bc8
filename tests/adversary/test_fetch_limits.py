"""Weight downloads outside the broadcast, over real libp2p hosts: a peer that is not admitted
(on the learner: has not joined) is refused before its request body is read; an admitted one is
paced by a per-peer token bucket (a catch-up takes at least its bytes over the rate; requests that
would wait too long are refused with ``rate_limited``); the broadcast streams are not paced."""

from __future__ import annotations

import struct
import time

import numpy as np
import trio
from libp2p.peer.id import ID
from swarm import safetensors_f32

from echorl.broadcast.broadcaster import Broadcaster
from echorl.broadcast.relay import Relay
from echorl.net.framing import read_frame
from echorl.net.host import RemoteError, open_host
from echorl.net.ratelimit import RateLimit, TokenBuckets
from echorl.protocol import wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import CatchUp, CatchUpRequest, Chunk, ChunkRequest
from echorl.protocol.routes import CATCHUP, CHUNK

CHUNK_BYTES = 64 * 1024


def _weights() -> bytes:
    return safetensors_f32(np.linspace(0, 1, 256 * 1024, dtype=np.float32))  # 1 MiB: 16 chunks


def test_token_bucket_reserve_paces_and_refuses_beyond_the_wait_bound() -> None:
    b = TokenBuckets(RateLimit(rate=100.0, burst=100.0))
    assert b.reserve("p", 100.0, max_wait_s=1.0, now=0.0) == 0.0
    assert b.reserve("p", 50.0, max_wait_s=1.0, now=0.0) == 0.5  # queued behind the burst
    assert b.reserve("p", 60.0, max_wait_s=1.0, now=0.0) is None  # 1.1 s: refused, nothing spent
    assert b.reserve("p", 50.0, max_wait_s=1.0, now=0.0) == 1.0
    assert b.reserve("q", 100.0, max_wait_s=0.0, now=0.0) == 0.0  # another peer: its own bucket


def test_unjoined_peer_is_refused_and_members_are_paced_apart_from_the_broadcast() -> None:
    async def main() -> None:
        li = Identity.generate()
        rate = 256 * 1024.0  # bytes/s a member may download outside the broadcast
        async with (
            open_host(li) as lh,
            open_host(Identity.generate()) as member,
            open_host(Identity.generate()) as stranger,
            open_host(Identity.generate()) as planned,
        ):
            joined = {member.peer_id, planned.peer_id}
            bc = Broadcaster(
                lh, li, "r", chunk_bytes=CHUNK_BYTES, direct=False, fetch_limit=RateLimit(rate, CHUNK_BYTES)
            )
            bc.server.admit = joined.__contains__
            bc.server.fetch_max_wait_s = 10.0
            bc.install()
            relay = Relay(planned, li.peer_id, "r", direct=False)
            relay.install()
            for h in (member, stranger, planned):
                await h.connect(lh.addrs[0])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay.run)
                # the broadcast to a plan member is not paced: 1 MiB at 256 KiB/s would take 4 s
                t0 = time.monotonic()
                report = await bc.publish(0, _weights(), [(planned.peer_id, True, ())], timeout=30.0)
                assert report.completed == [planned.peer_id] and time.monotonic() - t0 < 3.5
                nursery.cancel_scope.cancel()

            # a stranger: refused before its body is read (a 1 MiB frame header, 64 bytes sent)
            stream = await stranger.libp2p.new_stream(ID.from_base58(li.peer_id), [CATCHUP])
            await stream.write(struct.pack(">I", 1 << 20) + b"\0" * 64)
            with trio.fail_after(5):
                reply = wire.decode(await read_frame(stream, max_bytes=1 << 16, first_byte_timeout=5, io_timeout=5))
            assert reply.code == "not_found"
            digest = bc.server.chain.newest_run()[0].chunks[0].digest
            try:
                await stranger.request(li.peer_id, CHUNK, ChunkRequest(digest=digest), expect=Chunk)
                raise AssertionError("a stranger got a chunk")
            except RemoteError as exc:
                assert exc.code.value == "not_found"
            assert bc.server.counters["fetch_refused_unjoined"] == 2

            # a member catches up, no faster than the rate allows after the burst
            up = await member.request(li.peer_id, CATCHUP, CatchUpRequest(run_id="r", have_version=-1), expect=CatchUp)
            assert [m.version for m in up.manifests] == [0]
            fetcher = Relay(member, li.peer_id, "r", direct=False)
            t0 = time.monotonic()
            assert await fetcher.catch_up([li.peer_id], only=True) == 0
            payload = up.manifests[0].payload_bytes
            assert time.monotonic() - t0 >= 0.9 * (payload - CHUNK_BYTES) / rate

            # many chunk requests at once: those that would wait past the bound are refused
            bc.server.fetch_max_wait_s = 0.5
            codes: list[str] = []

            async def ask() -> None:
                try:
                    await member.request(li.peer_id, CHUNK, ChunkRequest(digest=digest), expect=Chunk)
                    codes.append("ok")
                except RemoteError as exc:
                    codes.append(exc.code.value)

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(ask)
            assert "rate_limited" in codes and bc.server.counters["fetch_rate_limited"] == codes.count("rate_limited")

    trio.run(main)
