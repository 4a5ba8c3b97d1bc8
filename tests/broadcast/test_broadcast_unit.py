"""Broadcast pieces in one process: the upload limiter, both chunk transports (libp2p streams
and direct TCP), every plan shape, full + delta versions applied bit-exactly."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import trio
from plans import share_a_plan
from swarm import safetensors_f32

from echorl.broadcast.broadcaster import Broadcaster, NodeInfo
from echorl.broadcast.relay import Relay
from echorl.net.host import open_host
from echorl.net.transport import UploadLimiter, slice_bytes_for, write_paced
from echorl.protocol.identity import Identity

pytestmark = pytest.mark.timeout(90)


def test_upload_limiter_paces_to_its_rate():
    async def main():
        lim = UploadLimiter(1_000_000)  # 1 MB/s
        t = time.perf_counter()

        async def user():
            for _ in range(8):
                await lim.acquire(64 * 1024)

        async with trio.open_nursery() as n:
            for _ in range(2):
                n.start_soon(user)
        elapsed = time.perf_counter() - t
        # 1 MiB at 1 MB/s, less the initial burst of 64 KiB
        assert 0.9 < elapsed < 1.5, elapsed
        assert lim.sent_bytes == 16 * 64 * 1024
        assert UploadLimiter.from_mbps(20).rate == 2.5e6 and UploadLimiter.from_mbps(None).rate is None

    trio.run(main)


def test_slices_last_a_few_milliseconds_of_the_capped_rate():
    assert slice_bytes_for(2.5e6) == 64 * 1024  # 20 Mbit/s: the floor (26 ms a slice)
    assert slice_bytes_for(50e6) == 249856  # 400 Mbit/s: 5 ms (250 kB), in 4 KiB units
    assert slice_bytes_for(1e9) == 1024 * 1024  # the ceiling
    assert slice_bytes_for(None) == 256 * 1024
    assert UploadLimiter.from_mbps(400).slice_bytes == 249856


@pytest.mark.parametrize("views", [True, False])
def test_a_paced_write_is_one_frame_in_slices_each_paid_for(views):
    """Header and body arrive as one frame; every write is at most a slice and the limiter is
    charged every byte; a stream without ``accepts_views`` only ever sees ``bytes``."""
    from echorl.protocol import wire

    class Sink:
        accepts_views = views

        def __init__(self):
            self.writes = []

        async def write(self, data):
            assert views or isinstance(data, bytes)
            self.writes.append(bytes(data))

    body = bytes(range(256)) * 2000  # 512,000 bytes
    lim = UploadLimiter(None)
    sink = Sink()
    trio.run(write_paced, sink, body, lim, 5.0)
    assert b"".join(sink.writes) == wire.frame(body)
    assert max(map(len, sink.writes)) <= lim.slice_bytes and len(sink.writes) == 2
    assert lim.sent_bytes == len(body) + 4
    trio.run(write_paced, Sink(), b"", lim, 5.0)  # an empty body is its header alone
    assert lim.sent_bytes == len(body) + 8


@pytest.mark.parametrize("direct,shape", [(False, "striped"), (True, "striped"), (False, "tree"), (True, "star")])
def test_in_process_broadcast_full_and_delta(direct, shape):
    async def main():
        li = Identity.generate()
        async with (
            open_host(li) as lh,
            open_host(Identity.generate()) as h1,
            open_host(Identity.generate()) as h2,
            open_host(Identity.generate()) as h3,
        ):
            hosts = (h1, h2, h3)
            got: dict[str, list[tuple[int, str]]] = {h.peer_id: [] for h in hosts}
            bc = Broadcaster(
                lh,
                li,
                "r",
                fanout=2,
                chunk_bytes=32 * 1024,
                full_every=3,
                shape=shape,
                direct=direct,
                upload_limit=UploadLimiter.from_mbps(400),
            )
            bc.install()
            async with trio.open_nursery() as nursery:
                await nursery.start(bc.run)
                relays = []
                for h in hosts:

                    def cb(v, data, pid=h.peer_id):
                        got[pid].append((v, hashlib.sha256(data.read_bytes()).hexdigest()))

                    r = Relay(h, li.peer_id, "r", on_version=cb, direct=direct)
                    r.install()
                    nursery.start_soon(r.run)
                    relays.append(r)
                await trio.sleep(0.2)
                nodes = [NodeInfo(h.peer_id, True, tuple(h.addrs)) for h in hosts]
                w = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
                kinds = []
                for v in range(1, 5):
                    w[v * 10 : v * 10 + 50] += 1.0
                    data = safetensors_f32(w)
                    report = await bc.publish(v, data, nodes, timeout=30)
                    kinds.append(report.kind)
                    assert len(report.completed) == 3 and report.suspects == [], report
                    with trio.fail_after(10):
                        while any(not got[h.peer_id] or got[h.peer_id][-1][0] != v for h in hosts):
                            await trio.sleep(0.01)
                    assert {got[h.peer_id][-1][1] for h in hosts} == {hashlib.sha256(data).hexdigest()}
                assert kinds == ["full", "delta", "delta", "full"]
                assert all(r.version == 4 for r in relays)
                assert sum(r.pull.opened["direct"] for r in relays) > 0 if direct else True
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_adopted_full_snapshot_is_served_to_peers_catching_up():
    """A version a node got outside the broadcast (its on-disk snapshot, the fallback fetch) is
    served to peers catching up when its manifest is a full snapshot; a delta's is not."""
    from echorl.protocol import delta, snapshot

    learner = Identity.generate()  # signs manifests; no learner host runs: peers are the only source
    old = safetensors_f32(np.arange(20_000, dtype=np.float32))
    new = safetensors_f32(np.arange(20_000, dtype=np.float32) + 1)
    full, _ = snapshot.build_manifest(learner, "r", 7, 6, new, new, chunk_bytes=16 * 1024)
    as_delta, _ = snapshot.build_manifest(
        learner, "r", 7, 6, delta.encode_delta(old, new), new, chunk_bytes=16 * 1024, kind="delta", base_version=6
    )

    async def catch_up_from_holder(manifest) -> int:
        async with open_host(Identity.generate()) as ha, open_host(Identity.generate()) as hb:
            holder, late = Relay(ha, learner.peer_id, "r"), Relay(hb, learner.peer_id, "r")
            holder.install()
            late.install()
            assert await holder.adopt(7, new, manifest)
            share_a_plan(holder, learner, hb.peer_id)  # nodes serve the members of their plans only
            await hb.connect(ha.addrs[0])
            return await late.catch_up(sources=[ha.peer_id], timeout=20)

    assert trio.run(catch_up_from_holder, full) == 7
    assert trio.run(catch_up_from_holder, as_delta) == -1  # a delta needs its base: nothing served
