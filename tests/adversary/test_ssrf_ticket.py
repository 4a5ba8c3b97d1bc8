"""SSRF through direct-path tickets (issue 24, finding 3): a hostile plan member names another
address first in its announced addresses and answers ticket requests with a port and ticket
bytes of its choice, to make an honest peer connect to a third party and send it chosen bytes.

Direct connections go only to the IP of the authenticated libp2p connection, never to an
announced address (``net/transport/direct_tcp.py``), tickets are of one fixed length and what
is sent is their hash (``ticket_proof``), and the learner puts only dial-back-verified addresses
in plans (``learner/membership.py``). The third party here is a listener on 127.0.0.2."""

from __future__ import annotations

import itertools
import time
from contextlib import AsyncExitStack
from types import SimpleNamespace

import numpy as np
import pytest
import trio
from hostile import THIRD_PARTY, ThirdParty, aimed_addrs, plan_member, ticket_to
from swarm import safetensors_f32

from echorl.broadcast.broadcaster import Broadcaster, NodeInfo
from echorl.broadcast.relay import Relay
from echorl.learner.membership import Members
from echorl.learner.peers import PeerBook
from echorl.net.host import open_host
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Capability, JoinRequest
from echorl.protocol.plan import BroadcastPlan, PlanPeer, plan_broadcast

pytestmark = pytest.mark.timeout(120)


def has_edge(plan: BroadcastPlan, edge: tuple[str, str]) -> bool:
    return any(edge[1] in s.children.get(edge[0], ()) for s in plan.stripes)


def seed_with(learner: Identity, nodes: list[NodeInfo], edge: tuple[str, str]) -> int:
    """A plan seed whose plan has ``edge`` (parent, child)."""
    peers = [PlanPeer(n.peer_id, n.reachable, not n.reachable) for n in nodes]
    return next(s for s in range(200) if has_edge(plan_broadcast(learner.peer_id, peers, 2, s), edge))


@pytest.mark.parametrize("hostile_is", ["parent", "pushed_child"])
def test_a_hostile_plan_member_cannot_aim_an_honest_peer_at_another_address(hostile_is):
    """``parent``: the honest relay (reachable) asks its hostile plan parent for a ticket.
    ``pushed_child``: the honest node is behind NAT and pushes its stripe to the hostile
    (reachable) child. A reachable honest bystander completes the plan. Either way nothing
    reaches 127.0.0.2, and the honest node still gets the version (from other holders)."""

    async def main() -> None:
        li, hi, ei, bi = (Identity.generate() for _ in range(4))
        sink = ThirdParty()
        async with AsyncExitStack() as stack:
            lh, honest, hostile, bystander = [await stack.enter_async_context(open_host(i)) for i in (li, hi, ei, bi)]
            bc = Broadcaster(lh, li, "r", fanout=2, chunk_bytes=16 * 1024, full_every=1, direct=True)
            bc.install()
            async with trio.open_nursery() as nursery:
                await nursery.start(sink.run)
                plan_member(hostile, nursery, li.peer_id, report=True, run_id="r")
                ticket_to(hostile, sink)
                await nursery.start(bc.run)
                relays = [Relay(h, li.peer_id, "r", direct=True, stall_s=3.0) for h in (honest, bystander)]
                for r in relays:
                    r.install()
                    nursery.start_soon(r.run)
                # all connected beforehand: what is tested is the direct path, not libp2p's dialing
                # of the announced addresses (the learner keeps only verified ones: the test below)
                for a, b in itertools.combinations((lh, honest, hostile, bystander), 2):
                    await a.connect(b.addrs[0])
                aimed = tuple(aimed_addrs(hostile, sink))
                nodes = [
                    NodeInfo(hi.peer_id, hostile_is == "parent", tuple(honest.addrs)),
                    NodeInfo(ei.peer_id, True, aimed),
                    NodeInfo(bi.peer_id, True, tuple(bystander.addrs)),
                ]
                edge = (ei.peer_id, hi.peer_id) if hostile_is == "parent" else (hi.peer_id, ei.peer_id)
                w = np.random.default_rng(0).standard_normal(40_000).astype(np.float32)
                report = await bc.publish(1, safetensors_f32(w), nodes, timeout=20, seed=seed_with(li, nodes, edge))
                assert has_edge(bc._plans[1], edge)
                assert hi.peer_id in report.completed and relays[0].version == 1
                nursery.cancel_scope.cancel()
        assert (sink.connections, sink.bytes) == (0, 0)

    trio.run(main)


def test_plans_carry_only_the_dial_back_verified_address():
    """A joiner that lists a third party's address first keeps only the address that answered
    the learner's dial-back; one that lists nothing that answers keeps none and is a leaf."""

    def join(addrs: list[str], reachable: bool = True) -> JoinRequest:
        cap = Capability(
            engine="torch",
            device="cpu",
            memory_bytes=1,
            tokens_per_s=1.0,
            price_per_hour=0.0,
            reachable=reachable,
            listen_addrs=addrs,
        )
        me = Identity.generate()
        return JoinRequest(
            run_id="r", peer_id=me.peer_id, capability=cap, version=-1, timestamp=time.time(), nonce=b"n" * 16
        )

    async def main() -> None:
        async with open_host(Identity.generate()) as learner, open_host(Identity.generate()) as node:
            await node.connect(learner.addrs[0])
            members = Members(SimpleNamespace(peer_id=learner.peer_id), "r")
            policy = SimpleNamespace(liveness_after_s=10.0, ping_timeout_s=5.0)
            real = node.addrs[0]
            aimed = [f"/ip4/{THIRD_PARTY}/tcp/9/p2p/{node.peer_id}", "/ip4/127.0.0.1/tcp/9", real]
            cap = await members.admit(join(aimed), node.peer_id, PeerBook(), learner, policy)
            assert cap.reachable and list(cap.listen_addrs) == [real]
            cap = await members.admit(join(aimed[:2]), node.peer_id, PeerBook(), learner, policy)
            assert not cap.reachable and list(cap.listen_addrs) == []
            cap = await members.admit(join([real], reachable=False), node.peer_id, PeerBook(), learner, policy)
            assert not cap.reachable and list(cap.listen_addrs) == []

    trio.run(main)
