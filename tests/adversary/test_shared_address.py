"""One attacker behind a shared IPv4 address (a carrier NAT, a campus; issue 24, finding 6)
against the real ``LearnerService`` (signed joins and submissions, the real buffer and checks, no
network): its identities hold all ``max_peers_per_ip`` join slots with one accepted submission
each and then idle, and a few fresh identities from another address hold the whole unproven
half of the in-flight budget. Before, honest newcomers behind the shared address were refused
``peer_limit`` and, once in, never got a lease while the fresh identities kept the budget full.
Now a newcomer takes the slot of the address's member that worked least recently (never a
proven worker's, a lease holder's or one within its grace), and the unproven budget is shared
by address, so the honest newcomers get in, get leases, prove themselves and keep their slots."""

from __future__ import annotations

import time
from types import SimpleNamespace

import trio
from swarm import capability, signed_submit
from test_hostile_rollouts import RUN, _service, tiny  # noqa: F401 - fixture
from test_sybil_flood import FakeHost
from test_sybil_flood import _join as join

from echorl.learner.admission import Admission
from echorl.learner.newcomers import ASKING_WINDOW_S
from echorl.learner.pace import PROVEN_LEASES
from echorl.learner.peers import PeerBook
from echorl.learner.service import LearnerService
from echorl.net.host import RequestContext
from echorl.protocol import routes
from echorl.protocol.errors import ErrorCode
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Lease, LeaseDeferred, LeaseRequest, SubmitAccepted

SHARED = "100.64.0.9"  # a carrier-grade NAT address: the attacker and the honest peers behind it
OTHER = "203.0.113.7"  # the attacker's second address, for fresh identities
SLOTS = 8  # max_peers_per_ip (small: the rule does not depend on it)
GRACE_S = 60.0  # idle_member_drop_s: a newcomer's time to prove itself


def _ctx(me: Identity) -> RequestContext:
    return RequestContext(peer_id=me.peer_id, protocol=routes.LEASE, received_at=time.time())


async def _ask(svc: LearnerService, me: Identity) -> Lease | LeaseDeferred:
    svc.admission.told_to_wait(me.peer_id, 0.0, 0.0)  # the test steps time by hand: any retry_after passed
    reply = await svc.on_lease(LeaseRequest(run_id=RUN, version=svc.published, max_prompts=2), _ctx(me))
    assert isinstance(reply, (Lease, LeaseDeferred)), reply
    return reply


def _expire_all(svc: LearnerService) -> None:
    """Every open lease runs past its deadline unanswered."""
    for rec in svc.leases.expire_due(time.monotonic() + 1e4):
        svc.buffer.requeue(rec.prompts)
        svc.admission.on_expired(rec.peer_id)


async def _fresh_holders(svc: LearnerService, host: FakeHost, n: int) -> list[Lease]:
    """``n`` fresh identities from ``OTHER`` join and ask; the leases they got (never answered)."""
    got = []
    for _ in range(n):
        me = Identity.generate()
        assert await join(svc, host, me, OTHER) == "ok"
        reply = await _ask(svc, me)
        if isinstance(reply, Lease):
            got.append(reply)
    return got


def test_honest_peers_behind_an_attackers_shared_address_get_in_and_get_leases(tiny) -> None:  # noqa: F811
    async def main() -> None:
        svc = _service(
            tiny,
            prompts_per_step=8,
            prompts_per_lease=2,
            staleness=2,
            max_peers_per_ip=SLOTS,
            idle_member_drop_s=GRACE_S,
        )
        host = FakeHost()
        svc.host = host  # type: ignore[assignment]
        svc.note_published(0)
        budget = svc.rule.in_flight_cap // 2  # prompts all unproven peers may hold together
        # fresh identities from another address take the whole unproven budget
        first = await _fresh_holders(svc, host, budget)
        assert sum(len(x.prompts) for x in first) == budget
        # the attacker's identities fill the shared address, each with one accepted submission
        # (a worker: never dropped as idle), then idle; they joined long ago
        squatters = [Identity.generate() for _ in range(SLOTS)]
        for me in squatters:
            assert await join(svc, host, me, SHARED) == "ok"
            rec = svc.peers[me.peer_id]
            rec.account.submissions_accepted = rec.account.groups_accepted = 1
            rec.joined_at -= 2 * GRACE_S

        honest = [Identity.generate() for _ in range(2)]
        for me in honest:  # before: peer_limit
            assert await join(svc, host, me, SHARED) == "ok"
        assert svc.roster.counters["members_displaced"] == 2 and svc.roster.counters["joins_refused_ip_cap"] == 0
        # another fresh identity from the shared address displaces an idle squatter, never a
        # newcomer within its grace
        assert await join(svc, host, Identity.generate(), SHARED) == "ok"
        assert all(me.peer_id in svc.peers for me in honest)
        for me in honest:
            assert isinstance(await _ask(svc, me), LeaseDeferred)  # the budget is full

        # the fresh identities' leases end (unanswered, expired); new fresh identities ask first
        _expire_all(svc)
        second = await _fresh_holders(svc, host, budget)
        assert sum(len(x.prompts) for x in second) == budget // 2  # OTHER's share only (before: all of it)

        # the honest newcomers get leases, answer them in time, and are proven
        for _ in range(PROVEN_LEASES):
            for me in honest:
                lease = await _ask(svc, me)
                # on honest[1]'s third: honest[0] is proven, newcomers share a lease per four proven
                # peers and OTHER's unanswered one holds it, but the honest pair's second answers in
                # time earned newcomers two more (learner/newcomers.py): it need not wait a deadline
                assert isinstance(lease, Lease), lease  # before: deferred, the budget held by OTHER
                reply = await svc.on_submit(signed_submit(me, lease, svc.published, vary=True), _ctx(me))
                assert isinstance(reply, SubmitAccepted) and reply.accepted == len(lease.prompts)
                # the trainer takes the groups as they come: once the first honest peer is proven
                # and another unproven peer holds a lease, the crowd rule keeps the proven one's
                # second lease out of the in-flight budget, and the groups waiting would fill the rest
                svc.buffer.take(len(svc.buffer), 0)
        assert all(svc.admission.trusted(me.peer_id) for me in honest)

        # long after, fresh identities from the shared address displace every squatter but never
        # a proven worker; then the address is full
        for me in list(svc.peers.values()):
            me.joined_at -= 2 * GRACE_S
        codes = [await join(svc, host, Identity.generate(), SHARED) for _ in range(SLOTS)]
        assert codes.count("ok") == SLOTS - len(honest)
        assert codes.count(ErrorCode.PEER_LIMIT.value) == len(honest)
        assert all(me.peer_id in svc.peers for me in honest)
        assert not any(me.peer_id in svc.peers for me in squatters)
        assert svc.status().learner["members_displaced"] == 2 + 1 + SLOTS - len(honest)

    trio.run(main)


def test_a_proven_worker_that_stopped_answering_can_be_displaced(tiny) -> None:  # noqa: F811
    async def main() -> None:
        svc = _service(tiny, max_peers_per_ip=1, idle_member_drop_s=GRACE_S)
        host = FakeHost()
        svc.host = host  # type: ignore[assignment]
        worker = Identity.generate()
        assert await join(svc, host, worker, SHARED) == "ok"
        now = time.monotonic()
        svc.peers[worker.peer_id].joined_at = now - 2 * GRACE_S
        load = svc.peers.load(worker.peer_id)
        load.on_time_in_row, load.worked_at = PROVEN_LEASES, now
        key = svc.peers[worker.peer_id].ip_key
        assert svc.roster.displaceable(key, {}, now=now) is None  # a proven, recent worker
        assert svc.roster.displaceable(key, {}, now=now + 1e4) == worker.peer_id  # it stopped long ago
        load.on_time_in_row = 0
        assert svc.roster.displaceable(key, {worker.peer_id: 1}, now=now) is None  # it holds a lease
        assert svc.roster.displaceable(key, {}, now=now) == worker.peer_id

    trio.run(main)


def test_the_unproven_budget_is_split_among_addresses_asking_for_work() -> None:
    book = PeerBook()
    ids = {name: Identity.generate().peer_id for name in ("a", "b", "h", "idle1", "idle2")}
    for pid, ip in zip(ids.values(), ("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4")):
        book.join(pid, capability(), 0, ip)
    adm = Admission(book)

    def room(name: str, now: float) -> int:  # an in-flight cap of 16: a budget of 8 unproven prompts
        return adm.newcomers.room(ids[name], 16, 2, [], now=now)

    assert room("a", 0.0) == 8  # one address asking: all of it (idle members shrink nothing)
    assert room("h", 1.0) == 4 and room("b", 1.5) == 4  # two addresses asking: half each
    assert room("a", 2.0 + ASKING_WINDOW_S) == 8  # the other address stopped asking


def test_a_freed_newcomer_lease_goes_to_the_address_whose_turn_it_is() -> None:
    """With room for one unproven lease (two proven peers at work), a crowd of identities on one
    address asking more often than a newcomer on another would win every freed slot. The address
    whose last unproven lease is oldest goes first: the crowd's next identity waits while the
    newcomer, waiting too, has never had one; then the crowd's turn comes again."""
    book = PeerBook()
    adm = Admission(book)
    proven = [Identity.generate().peer_id for _ in range(2)]
    crowd = [Identity.generate().peer_id for _ in range(3)]
    newcomer = Identity.generate().peer_id
    for i, pid in enumerate(proven):
        book.join(pid, capability(), 0, f"10.0.1.{i}")
        book.load(pid).on_time_in_row = PROVEN_LEASES
    for pid in crowd:
        book.join(pid, capability(), 0, "10.0.0.1")
    book.join(newcomer, capability(), 0, "10.0.0.2")
    now, out = time.monotonic(), []  # the unproven leases out: (holder, prompts)

    def lease(pid: str, dt: float) -> int:  # prompts leased (in-flight cap 16, 2-prompt leases)
        active = [SimpleNamespace(peer_id=h, prompts=[None] * n) for h, n in out]
        n = adm.lease_prompts(pid, 2, 16, {p: 2 for p in proven}, active, 16, 2, now + dt)  # type: ignore[arg-type]
        out.extend([(pid, n)] if n > 0 else [])
        return n

    assert adm.newcomers.budget(16, 2, now) == 2  # one lease for two proven peers
    assert lease(crowd[0], 0.0) == 2  # the crowd holds it
    assert lease(newcomer, 0.1) == 0 and lease(crowd[1], 0.2) == 0  # both wait
    out.clear()  # it settles; the crowd asks first again, but the newcomer's address never had one
    assert lease(crowd[2], 0.3) == 0  # before: the crowd's, as every freed slot would be
    assert lease(newcomer, 0.4) == 2
    out.clear()  # now the crowd's last lease is the older: its turn
    assert lease(newcomer, 0.5) == 0
    assert lease(crowd[1], 0.6) == 2
