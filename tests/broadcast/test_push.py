"""Pushed edges (broadcast/push.py): a node that cannot be dialled relays by dialling its
reachable plan children and pushing its stripe; in one process, on loopback, with some nodes
announced as unreachable so that the plan makes them pushing parents."""

from __future__ import annotations

import hashlib
from contextlib import AsyncExitStack

import numpy as np
import pytest
import trio
from swarm import safetensors_f32

from echorl.broadcast.broadcaster import Broadcaster, NodeInfo
from echorl.broadcast.relay import Relay
from echorl.net.host import RemoteError, open_host
from echorl.net.transport import UploadLimiter
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Subscribe
from echorl.protocol.routes import PUSH

pytestmark = pytest.mark.timeout(90)


async def _lab(n_pub: int, n_nat: int, direct: bool, check) -> None:
    li = Identity.generate()
    async with open_host(li) as lh:
        hosts = []
        async with AsyncExitStack() as stack:
            for _ in range(n_pub + n_nat):
                hosts.append(await stack.enter_async_context(open_host(Identity.generate())))
            bc = Broadcaster(
                lh,
                li,
                "r",
                fanout=2,
                chunk_bytes=16 * 1024,
                full_every=1,
                direct=direct,
                upload_limit=UploadLimiter.from_mbps(400),
            )
            bc.install()
            async with trio.open_nursery() as nursery:
                await nursery.start(bc.run)
                relays = []
                for h in hosts:
                    r = Relay(h, li.peer_id, "r", direct=direct, stall_s=20.0)
                    r.install()
                    nursery.start_soon(r.run)
                    relays.append(r)
                await trio.sleep(0.2)
                nodes = [NodeInfo(h.peer_id, i < n_pub, tuple(h.addrs)) for i, h in enumerate(hosts)]
                await check(bc, nodes, relays, hosts)
                nursery.cancel_scope.cancel()


@pytest.mark.parametrize("direct", [True, False])
def test_unreachable_nodes_push_their_stripes_to_reachable_children(direct):
    """2 reachable + 2 unreachable nodes, k = 2: the unreachable ones are interior (their
    uplinks carry a stripe), every node gets every version intact from its plan parent (no
    chunk recovered outside the plan), over the direct TCP path or libp2p streams."""

    async def check(bc, nodes, relays, hosts):
        w = np.random.default_rng(1).standard_normal(60_000).astype(np.float32)
        for v in (1, 2):
            w[v : v + 100] += 1.0
            data = safetensors_f32(w)
            report = await bc.publish(v, data, nodes, timeout=30)
            assert sorted(report.completed) == sorted(n.peer_id for n in nodes), report
            assert report.recovered_chunks == 0 and report.suspects == [], report
            digest = hashlib.sha256(data).digest()
            assert all(r.result_digest and hashlib.sha256(r.result).digest() == digest for r in relays)
        plan = bc._plans[2]
        nat = [n.peer_id for n in nodes if not n.reachable]
        assert all(plan.upload_copies(p) > 0 for p in nat)  # the plan uses their uplinks
        for r in relays:  # a pushed stripe's frames are timed in transit too (issue 27: the weights)
            state = r.server.states[2]
            timed = {x.stripe: x for x in state.streams() or ()}
            for s, parent in state.parents.items():
                if parent in nat:
                    assert timed[s].bytes > 0 and timed[s].seconds > 0, (s, timed)
        assert all(bc.uplinks.weight(p) is not None for p in nat)
        pushers = [r for r, n in zip(relays, nodes) if not n.reachable]
        assert all(r.pusher.pushed_streams > 0 for r in pushers)
        assert (
            sum(r.pusher.pushed_streams for r in relays)
            == sum(1 for s in plan.stripes for p, cs in s.children.items() for c in cs if plan.pushed(p, c)) * 2
        )

    trio.run(_lab, 2, 2, direct, check)


def test_push_ticket_only_for_the_plan_parent_on_a_pushed_edge():
    """A peer that is not the child's pushing parent in that stripe gets no ticket."""

    async def check(bc, nodes, relays, hosts):
        w = np.zeros(20_000, dtype=np.float32)
        await bc.publish(1, safetensors_f32(w), nodes, timeout=30)
        reachable = next(i for i, n in enumerate(nodes) if n.reachable)
        other = next(i for i, n in enumerate(nodes) if n.reachable and i != reachable)
        await hosts[other].connect(hosts[reachable].addrs[0])
        for stripe in (0, 1):  # other is reachable: never a pushing parent
            with pytest.raises(RemoteError):
                await hosts[other].request(
                    hosts[reachable].peer_id, PUSH, Subscribe(run_id="r", version=1, stripe=stripe), timeout=10
                )
        with pytest.raises(RemoteError):  # no such version: refused after the announce wait
            await hosts[other].request(
                hosts[reachable].peer_id, PUSH, Subscribe(run_id="other", version=1, stripe=0), timeout=10
            )

    trio.run(_lab, 2, 2, True, check)
