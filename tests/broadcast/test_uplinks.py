"""The learner's uplink weights (issue 27): measured from what plan children timed from their
parents, bounded where a report enters, and what the next plans are built with."""

from __future__ import annotations

import numpy as np
import pytest
import trio
from swarm import safetensors_f32

from echorl.broadcast.broadcaster import Broadcaster, NodeInfo
from echorl.broadcast.relay import Relay
from echorl.broadcast.uplinks import KEEP_FOR, MIN_SECONDS, WEIGHT_UNIT, UplinkMeter, stripe_bytes, weight_of
from echorl.net.host import open_host
from echorl.net.transport import UploadLimiter
from echorl.protocol.identity import Identity
from echorl.protocol.messages import BroadcastDone, ChunkRef, Manifest, StreamRate
from echorl.protocol.plan import MAX_WEIGHT, PlanPeer, plan_broadcast

pytestmark = pytest.mark.timeout(90)
CHUNK = 64 * 1024


def _manifest(n_chunks: int) -> Manifest:
    chunks = [ChunkRef(digest=bytes([i]) * 32, size=CHUNK) for i in range(n_chunks)]
    return Manifest.model_construct(chunks=chunks, chunk_bytes=CHUNK, payload_bytes=CHUNK * n_chunks)


def _done(ok: bool = True, *streams: tuple[int, int, float]) -> BroadcastDone:
    rates = [StreamRate(stripe=s, bytes=b, seconds=t) for s, b, t in streams]
    return BroadcastDone(
        run_id="r", version=1, ok=ok, seconds=1.0, recovered_chunks=0, suspects=[], detail="", streams=rates or None
    )


def test_a_relay_s_rate_is_what_its_children_timed_bounded_and_only_from_its_own_children():
    plan = plan_broadcast("L", [PlanPeer(f"p{i}") for i in range(12)], 2, seed=1)
    manifest = _manifest(8)  # 4 chunks per stripe
    per_stripe = stripe_bytes(manifest, 2)
    assert per_stripe == [4 * CHUNK, 4 * CHUNK]
    root = plan.stripes[0].children["L"][0]
    relay = next(p for p, cs in plan.stripes[0].children.items() if p not in ("L", root) and len(cs) == 2)
    kids = plan.stripes[0].children[relay]
    outsider = next(p for p in plan.peers if plan.stripes[0].parent_of()[p] not in (relay, "L"))
    meter = UplinkMeter()
    done = {
        kids[0]: _done(True, (0, 3 * CHUNK, 1.0)),
        kids[1]: _done(True, (0, 10**12, 0.0)),  # claims a petabyte at once: capped, floored, outvoted
        outsider: _done(True, (0, 3 * CHUNK, 0.001)),  # about its own parent, not ``relay``
        root: _done(True, (0, 3 * CHUNK, 0.001)),  # its parent is the learner: nobody measured
    }
    meter.note(plan, manifest, done, n_pub=1)
    assert meter.rate[relay] == pytest.approx(2 * 3 * CHUNK / 1.0)  # 2 streams × the lower median
    parent_of_outsider = plan.stripes[0].parent_of()[outsider]
    assert set(meter.rate) == {relay, parent_of_outsider}  # the root's report names the learner: unused
    assert meter.rate[parent_of_outsider] == pytest.approx(3 * CHUNK / MIN_SECONDS)
    assert meter.weight(relay) == weight_of(6 * CHUNK)
    alone = UplinkMeter()  # the liar alone: bounded by the stripe's bytes and the floor
    alone.note(plan, manifest, {kids[1]: done[kids[1]]}, n_pub=1)
    assert alone.rate[relay] == pytest.approx(4 * CHUNK / MIN_SECONDS)
    assert meter.weight("never-measured") is None

    failed = UplinkMeter()  # a report of a version not verified counts for nothing
    failed.note(plan, manifest, {kids[0]: _done(False, (0, 3 * CHUNK, 1.0))}, n_pub=1)
    assert failed.rate == {}

    meter.note(plan, manifest, {kids[0]: _done(True, (0, 3 * CHUNK, 3.0))}, n_pub=2)  # averaged
    assert meter.rate[relay] == pytest.approx((6 * CHUNK + CHUNK) / 2)
    meter.note(plan, manifest, {}, n_pub=2 + KEEP_FOR)  # nothing new for KEEP_FOR publications
    assert meter.weight(relay) is None


def test_weights_are_bounded_and_steady():
    assert weight_of(0.0) == 1 and weight_of(1e30) == MAX_WEIGHT
    assert weight_of(20e6 / 8) == weight_of(20.5e6 / 8)  # a few percent: the same weight, the same plan
    assert weight_of(100e6 / 8) > 4 * weight_of(20e6 / 8) > 4 * weight_of(5e6 / 8) * 0.9
    assert abs(weight_of(50 * WEIGHT_UNIT) - 50) <= 50 * 0.1


def test_a_broadcast_measures_its_relays_and_the_next_plan_carries_their_weights():
    async def main():
        li = Identity.generate()
        async with (
            open_host(li) as lh,
            open_host(Identity.generate()) as h1,
            open_host(Identity.generate()) as h2,
            open_host(Identity.generate()) as h3,
            open_host(Identity.generate()) as h4,
        ):
            hosts = (h1, h2, h3, h4)
            bc = Broadcaster(lh, li, "r", fanout=2, chunk_bytes=32 * 1024, upload_limit=UploadLimiter.from_mbps(400))
            bc.install()
            bc.weigh = True  # off by default (echorl learner --plan-weights)
            async with trio.open_nursery() as nursery:
                await nursery.start(bc.run)
                for h in hosts:
                    r = Relay(h, li.peer_id, "r")
                    r.install()
                    nursery.start_soon(r.run)
                await trio.sleep(0.2)
                nodes = [NodeInfo(h.peer_id, True, tuple(h.addrs)) for h in hosts]
                w = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
                first = await bc.publish(1, safetensors_f32(w), nodes, timeout=30)
                assert len(first.completed) == 4
                assert all(m.weight is None for m in bc.server.states[1].announce.members)  # nobody measured yet
                plan = bc._plans[1]
                relays = {p for s in plan.stripes for p, cs in s.children.items() if p != plan.learner and cs}
                assert relays and set(bc.uplinks.rate) == relays  # each relay, timed by its children
                assert all(0 < r <= MAX_WEIGHT * WEIGHT_UNIT for r in bc.uplinks.rate.values())
                measured = dict(bc.uplinks.rate)
                w[:50] += 1.0
                await bc.publish(2, safetensors_f32(w), nodes, timeout=30)
                weights = {m.peer_id: m.weight for m in bc.server.states[2].announce.members}
                assert {p for p, x in weights.items() if x is not None} == relays
                assert all(weights[p] == weight_of(measured[p]) for p in relays)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_stream_s_transit_time_leaves_out_the_waits_between_frames():
    """A parent fed slowly waits 5 s before each frame, then sends it in 0.1 s: the child times
    0.1 s a frame, what the parent's uplink took, not the 5.1 s its feed did."""
    from trio.testing import MockClock

    from echorl.net.transport.base import FramedStream
    from echorl.protocol import wire

    class SlowlyFed:
        def __init__(self, bodies: list[bytes]) -> None:
            self.parts: list[tuple[float, bytes]] = []
            for body in bodies:
                frame = wire.frame(body)
                self.parts += [(5.0, frame[:3]), (0.1, frame[3:])]

        async def read(self, n: int) -> bytes:
            if not self.parts:
                return b""
            delay, data = self.parts[0]
            await trio.sleep(delay)
            self.parts[0] = (0.0, data[n:])
            if not data[n:]:
                self.parts.pop(0)
            return data[:n]

    async def main() -> tuple[float, float, int]:
        stream = FramedStream(SlowlyFed([b"x" * 1000] * 3), io_timeout=30.0)
        t0 = trio.current_time()
        got = [body async for body in stream.frames(first_byte_timeout=10.0)]
        return trio.current_time() - t0, stream.transit_s, len(got)

    wall, transit, n = trio.run(main, clock=MockClock(autojump_threshold=0))
    assert n == 3 and wall == pytest.approx(15.3) and transit == pytest.approx(0.3)
