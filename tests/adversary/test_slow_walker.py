"""The slow-walking lease hoarder (issue 24, finding 1) against the real ``LearnerService`` (the
tiny model's tokenizer, the real buffer and checks), on the learner's real clock: three
identities from one address answer their first lease at once, then every later one just before
its deadline. Before, their deadlines grew from their own slow rate (30 s here), any accepted
answer wiped their record and they won every freed slot by polling: the honest node got no work.
Now deadlines follow the fleet's pace, a late answer backs its peer off like an expiry, and room
is kept for the faster peer, so the honest node keeps most of its clean goodput."""

from __future__ import annotations

import time

import trio
from swarm import capability, signed_submit
from test_hostile_rollouts import RUN, _service, tiny  # noqa: F401 - fixture

from echorl.learner.service import LearnerService, PeerRecord
from echorl.net.host import RequestContext
from echorl.protocol import routes
from echorl.protocol.errors import ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Lease, LeaseRequest, SubmitAccepted

CLEAN_S = 3.0
ATTACK_S = 8.0
HONEST_WORK_S = 0.05  # the honest node's time for one lease
WALKERS = 3


def _join(svc: LearnerService, me: Identity, ip: str) -> RequestContext:
    now = time.monotonic()
    svc.peers.add(PeerRecord(me.peer_id, capability(), now, now, version=0, ip_key=ip))
    return RequestContext(peer_id=me.peer_id, protocol=routes.LEASE, received_at=time.time())


async def _lease(svc: LearnerService, ctx: RequestContext) -> Lease | float:
    """A lease, or the seconds to wait before asking again."""
    reply = await svc.on_lease(LeaseRequest(run_id=RUN, version=svc.published, max_prompts=2), ctx)
    return reply if isinstance(reply, Lease) else max(0.01, reply.retry_after_s)  # earlier: refused


async def _submit(svc: LearnerService, me: Identity, ctx: RequestContext, lease: Lease) -> int:
    try:
        reply = await svc.on_submit(signed_submit(me, lease, svc.published, token_ids=(4,), logprobs=(-1.0,)), ctx)
    except ProtocolError:
        return 0
    assert isinstance(reply, SubmitAccepted)
    return reply.accepted


def test_slow_walking_identities_cannot_starve_an_honest_node(tiny) -> None:  # noqa: F811
    async def main() -> None:
        version = [0]
        svc = _service(
            tiny, version=lambda: version[0], prompts_per_step=4, prompts_per_lease=2, staleness=3, lease_timeout_s=30.0
        )
        svc.note_published(0)
        honest = Identity.generate()
        hctx = _join(svc, honest, "10.0.0.1")
        accepted = {"honest": 0, "walkers": 0}

        async def trainer() -> None:  # one step per B buffered groups, each version published
            while True:
                if svc.buffer.take(4, version[0]) is not None:
                    version[0] += 1
                    svc.note_published(version[0])
                await trio.sleep(0.01)

        async def honest_node() -> None:
            while True:
                got = await _lease(svc, hctx)
                if isinstance(got, float):
                    await trio.sleep(got)
                    continue
                await trio.sleep(HONEST_WORK_S)
                accepted["honest"] += await _submit(svc, honest, hctx, got)

        async def walker(me: Identity, ctx: RequestContext) -> None:
            answered = 0
            while True:
                try:
                    got = await _lease(svc, ctx)
                except ProtocolError:  # refused for the run
                    return
                if isinstance(got, float):
                    await trio.sleep(max(got, 0.04))  # polls 25 times a second, or as told (earlier: refused)
                    continue

                async def answer(lease: Lease, at_once: bool) -> None:
                    if not at_once:  # just before its deadline
                        await trio.sleep(max(0.0, lease.deadline_s - 0.2))
                    accepted["walkers"] += await _submit(svc, me, ctx, lease)

                nursery.start_soon(answer, got, answered == 0)
                answered += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trainer)
            nursery.start_soon(honest_node)
            await trio.sleep(CLEAN_S)
            clean = accepted["honest"] / CLEAN_S
            start = accepted["honest"]
            for _ in range(WALKERS):
                me = Identity.generate()
                nursery.start_soon(walker, me, _join(svc, me, "203.0.113.7"))
            await trio.sleep(ATTACK_S)
            during = (accepted["honest"] - start) / ATTACK_S
            nursery.cancel_scope.cancel()
        assert clean > 0
        assert during >= 0.6 * clean, (during, clean, accepted, svc.counters)
        assert svc.counters["leases_late"] >= WALKERS  # each walker's slow answer counted against it

    trio.run(main)


def test_one_address_holds_at_most_its_lease_cap_whatever_its_identities(tiny) -> None:  # noqa: F811
    """``max_leases_per_ip``: proven identities of one address together hold at most the cap
    (counted per address as leases are issued and settled, ``LeaseBook.held_at``: no scan of the
    holders per request); a peer of another address is still served, and a settled lease gives
    the address its room back."""

    async def main() -> None:
        svc = _service(tiny, prompts_per_step=64, prompts_per_lease=2, max_leases_per_ip=3, max_leases_per_peer=4)
        svc.note_published(0)
        crowd = [_join(svc, Identity.generate(), "198.18.0.7") for _ in range(5)]
        other = _join(svc, Identity.generate(), "198.18.0.8")
        for ctx in [*crowd, other]:
            for _ in range(3):  # proven: past the newcomer rules
                svc.admission.on_result(ctx.peer_id, groups=2, issued_at=time.monotonic() - 1.0)
        got = []
        for ctx in crowd * 2:
            svc.admission.told_to_wait(ctx.peer_id, 0.0, 0.0)
            got.append(await _lease(svc, ctx))
        leases = [g for g in got if isinstance(g, Lease)]
        assert len(leases) == 3 and svc.leases.held_at("198.18.0.7") == 3
        assert isinstance(await _lease(svc, other), Lease)  # another address is not held back
        svc.leases.settle(leases[0].lease_id, "result")
        svc.admission.told_to_wait(crowd[4].peer_id, 0.0, 0.0)
        assert isinstance(await _lease(svc, crowd[4]), Lease) and svc.leases.held_at("198.18.0.7") == 3

    trio.run(main)
