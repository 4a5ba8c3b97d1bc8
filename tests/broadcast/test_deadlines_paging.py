"""Deadlines that scale with the bytes moved (``broadcast/deadlines.py``) and used by the relay,
the chunk server and the broadcaster; catch-up served in pages that a node follows to the end."""

from __future__ import annotations

import numpy as np
import pytest
import trio
from swarm import safetensors_f32

from echorl.broadcast import chunk_server
from echorl.broadcast.broadcaster import Broadcaster
from echorl.broadcast.deadlines import MB, BandwidthMeter, Deadlines, transfer_deadline, upload_copies
from echorl.broadcast.relay import Relay
from echorl.broadcast.store import VersionState, WeightStore, plan_of
from echorl.net.host import open_host
from echorl.protocol import snapshot, wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import PlanAnnounce, PlanMember

pytestmark = pytest.mark.timeout(120)
GB = 1_000_000_000


def test_transfer_deadline_is_base_plus_bytes_over_bandwidth_times_safety():
    assert transfer_deadline(0, base_s=10.0) == 10.0
    assert transfer_deadline(100 * MB, 0.0, base_s=10.0, floor_bps=1 * MB, safety=3.0) == pytest.approx(310.0)
    # a measured rate above the floor shortens it; one below the floor does not lengthen it
    assert transfer_deadline(100 * MB, 50 * MB, base_s=10.0, floor_bps=1 * MB, safety=3.0) == pytest.approx(16.0)
    assert transfer_deadline(100 * MB, 0.1 * MB, base_s=10.0, floor_bps=1 * MB, safety=3.0) == pytest.approx(310.0)
    # a 60 GB model on a measured 100 MB/s link gets half an hour, not the 600 s that used to cut it off
    assert transfer_deadline(60 * GB, 100 * MB) == pytest.approx(10.0 + 1800.0)
    with pytest.raises(ValueError):
        Deadlines(safety=0.5)


def test_meter_averages_transfers_and_ignores_tiny_ones():
    meter = BandwidthMeter(weight=0.5)
    meter.add(1000, 0.001)  # too small to say anything
    assert meter.bps == 0.0
    meter.add(100 * MB, 1.0)
    assert meter.bps == pytest.approx(100 * MB)
    meter.add(100 * MB, 2.0)
    assert meter.bps == pytest.approx(75 * MB)
    d = Deadlines(base_s=5.0, floor_bps=1 * MB, safety=2.0, meter=meter)
    assert d.for_bytes(150 * MB) == pytest.approx(5.0 + 4.0)
    assert d.for_bytes(150 * MB, hops=3) == pytest.approx(15.0 + 4.0)


def _announce(payload_bytes: int, n_members: int = 6) -> tuple[PlanAnnounce, Identity]:
    li = Identity.generate()
    members = [Identity.generate().peer_id for _ in range(n_members)]
    data = safetensors_f32(np.zeros(payload_bytes // 4, dtype=np.float32))
    manifest, _ = snapshot.build_manifest(li, "r", 0, -1, data, data, chunk_bytes=64 * 1024)
    ann = wire.sign(
        PlanAnnounce(
            run_id="r",
            learner_peer_id=li.peer_id,
            version=0,
            manifest=manifest,
            shape="striped",
            fanout=2,
            seed=0,
            learner_addrs=[],
            members=[PlanMember(peer_id=m, reachable=True, addrs=[]) for m in members],
            created_at=0.0,
        ),
        li,
    )
    return ann, li


def test_relay_and_chunk_server_deadlines_grow_with_the_version():
    """The relay's wait for a version and a parent's stripe stream use ``Deadlines``: a version
    ten times larger gets ten times the transfer part; an explicit ``version_timeout_s`` wins."""
    small, _ = _announce(1 * MB)
    big, _ = _announce(10 * MB)
    d = Deadlines(base_s=1.0, floor_bps=1 * MB, safety=1.0)
    relay = Relay.__new__(Relay)
    relay.version_timeout_s, relay.deadlines = None, d
    me = small.members[0].peer_id
    store = WeightStore()
    s_state, b_state = VersionState(small, me, store), VersionState(big, big.members[0].peer_id, store)
    depth = s_state.plan.depth
    assert relay.version_deadline(s_state) == pytest.approx(depth + small.manifest.payload_bytes / MB)
    assert relay.version_deadline(b_state) == pytest.approx(b_state.plan.depth + big.manifest.payload_bytes / MB)
    assert upload_copies(s_state.plan) == upload_copies(b_state.plan) == 1.0  # fanout 2 striped: ≤ 1 + 1/k
    relay.version_timeout_s = 7.0
    assert relay.version_deadline(b_state) == 7.0

    server = chunk_server.ChunkServer.__new__(chunk_server.ChunkServer)
    server.deadlines = d
    stripe_bytes = sum(b_state.manifest.chunks[i].size for i in b_state.stripe_indices(0))
    # a stripe's stream shares its parent's link with the other stripes: it may take the whole payload's time
    share = b_state.n_stripes * upload_copies(b_state.plan)
    assert server.stripe_deadline(b_state, 0) == pytest.approx(b_state.plan.depth + share * stripe_bytes / MB)
    assert server.stripe_deadline(b_state, 0) - b_state.plan.depth > 5 * (server.stripe_deadline(s_state, 0) - depth)


def test_broadcaster_waits_for_done_in_proportion_to_the_payload():
    async def main():
        li = Identity.generate()
        async with open_host(li) as lh:
            bc = Broadcaster(
                lh,
                li,
                "r",
                done_timeout_s=2.0,
                announce_timeout_s=1.0,
                deadlines=Deadlines(base_s=1.0, floor_bps=1 * MB, safety=2.0),
            )
            ann, _ = _announce(10 * MB)
            m, plan = ann.manifest, plan_of(ann)
            copies = upload_copies(plan)
            assert bc.done_deadline(m, plan) == pytest.approx(plan.depth + 2.0 * copies * m.payload_bytes / MB)
            assert bc.done_deadline(m, plan, timeout=1e6) == 1e6  # a caller's longer wait stands
            assert bc.announce_deadline(m, 10) >= 1.0 + 2.0 * snapshot.manifest_wire_bytes(m) / MB
            bc.deadlines.meter.add(m.payload_bytes, 0.1)  # fast swarm measured: shorter deadlines
            assert bc.done_deadline(m, plan) < plan.depth + 0.5 * copies
            star = plan_of(ann.model_copy(update={"shape": "star"}))  # the learner uploads 6 copies
            assert (
                upload_copies(star) == 6 and bc.done_deadline(m, star) > 5 * bc.done_deadline(m, plan) - 5 * plan.depth
            )

    trio.run(main)


def test_catch_up_follows_pages_to_the_newest_version(monkeypatch):
    """With a page budget that holds one manifest, a node with nothing still reaches the newest
    version of a full + 3 deltas chain: one ``CatchUp`` page per version, each marked ``more``."""
    monkeypatch.setattr(chunk_server.limits, "CATCHUP_PAGE_BYTES", 1)
    pages: list[tuple[list[int], bool]] = []
    original = chunk_server.ChunkServer._on_catch_up

    async def spy(self, msg, ctx):
        reply = await original(self, msg, ctx)
        pages.append(([m.version for m in reply.manifests], bool(reply.more)))
        return reply

    monkeypatch.setattr(chunk_server.ChunkServer, "_on_catch_up", spy)

    def weights(step: int) -> bytes:
        values = np.linspace(0, 1, 100_000, dtype=np.float32)
        values[: 1000 * step] += 1.0
        return safetensors_f32(values)

    async def main():
        li = Identity.generate()
        async with open_host(li) as lh, open_host(Identity.generate()) as ha:
            bc = Broadcaster(lh, li, "r", chunk_bytes=64 * 1024, full_every=10, direct=False)
            bc.install()
            for v in range(4):
                await bc.publish(v, weights(v), [])
            a = Relay(ha, li.peer_id, "r", direct=False)
            a.install()
            await ha.connect(lh.addrs[0])
            assert await a.catch_up([li.peer_id], only=True) == 3
            assert a.result == weights(3)

    trio.run(main)
    assert pages == [([0], True), ([1], True), ([2], True), ([3], False)]
