"""The learner service's bookkeeping of peers: the liveness sweep over real libp2p hosts (a quiet
peer that answers pings stays in broadcast plans; one that is gone — holding a lease or idle — is
marked dead within seconds, its leases expired and re-queued); lease deadlines from the fleet's
pace, late results counted against the peer;
and what a checkpoint keeps of the service (bans, node addresses, accounts), bad entries skipped."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
import trio

from echorl.learner.config import ServiceFields
from echorl.learner.service import LearnerService, PeerRecord
from echorl.net.host import open_host
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Capability
from echorl.rl.buffer import StalenessBuffer

ADDR = "/ip4/10.0.0.1/tcp/4001"
FRESH = Identity.generate().peer_id


def _record(peer_id: str, quiet_for_s: float) -> PeerRecord:
    cap = Capability(
        engine="torch",
        device="cpu",
        memory_bytes=0,
        tokens_per_s=1.0,
        price_per_hour=0.0,
        reachable=True,
        listen_addrs=[],
    )
    then = time.monotonic() - quiet_for_s
    return PeerRecord(peer_id, cap, then, then, version=0)


def test_sweep_keeps_answering_peers_and_drops_gone_ones() -> None:
    from echorl.tasks import load_task

    async def main() -> None:
        task = load_task("addition", digits=2, seed=0)
        learner = Identity.generate()
        svc = LearnerService(
            learner,
            "run-1",
            task,
            tokenizer=None,
            buffer=StalenessBuffer(4, scorer=task.reward),
            # a generous ping timeout: the live peer must answer even on loaded cores (2 s failed 3 of
            # 3 at load 4-12); the gone ones refuse the dial at once, so it does not slow the test
            settings=ServiceFields(liveness_after_s=0.5, ping_timeout_s=10.0),
            vocab_size=100,
        )
        async with open_host(learner) as host, open_host(Identity.generate()) as up:
            svc.install(host)
            await host.connect(up.addrs[0])
            async with open_host(Identity.generate()) as idle_gone, open_host(Identity.generate()) as holder_gone:
                await host.connect(idle_gone.addrs[0])
                await host.connect(holder_gone.addrs[0])
                gone = (idle_gone.peer_id, holder_gone.peer_id)
            # both hosts are stopped now; the learner still has records for all three peers
            for pid in (up.peer_id, *gone):
                svc.peers.add(_record(pid, quiet_for_s=10.0))
            prompts = svc.buffer.next_prompts(task, 4)
            svc.leases.issue(holder_gone.peer_id, prompts, 8, 0, time.monotonic(), timeout_s=600)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(svc.maintain, 0.1)
                # the gone ones refuse the dial at once, the live one's ping may take longer on loaded
                # cores: wait for both outcomes (before, the loop left when the gone ones were dead and
                # raced the live one's answer)
                with trio.fail_after(30):
                    while (
                        any(svc.peers[pid].alive for pid in gone)
                        or time.monotonic() - svc.peers[up.peer_id].last_seen > 9.0
                    ):
                        await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
            assert svc.peers[up.peer_id].alive
            assert time.monotonic() - svc.peers[up.peer_id].last_seen < 9.0  # pinged: it was 10 s quiet
            assert [n.peer_id for n in svc.broadcast_nodes()] == [up.peer_id]
            assert svc.leases.expired == 1 and not svc.leases.active  # the 600 s lease went at once
            requeued = svc.buffer.next_prompts(task, 4)
            assert sorted(p.prompt_id for p in requeued) == sorted(p.prompt_id for p in prompts)

    trio.run(main)


def _fleet(**policy: float):
    """An admission over a peer book with members joined from their own addresses."""
    from swarm import capability

    from echorl.learner.admission import Admission
    from echorl.learner.config import AdmissionFields
    from echorl.learner.peers import PeerBook

    book = PeerBook()
    adm = Admission(book, AdmissionFields(**policy))
    for i, pid in enumerate(("fast", "fast2", "fast3", "slow", "crawl", "new")):
        book.join(pid, capability(), 0, ip=f"10.0.0.{i + 1}")
    return adm


def test_lease_deadline_follows_the_fleet_s_pace_never_the_peer_s_own_rate() -> None:
    adm = _fleet()
    args = dict(group_size=8, max_new_tokens=256, base_s=30.0)
    # nobody measured yet: declared 151 tok/s, 2 prompts × 8 samples × 256 tokens ≈ 27 s → 4 × that
    assert adm.deadline("a", 2, declared_tokens_per_s=151.0, **args) == 4 * 2 * 8 * 256 / 151.0
    # a claimed 0 tok/s buys no long deadline: at most 4 × the base until the learner measured someone
    assert adm.deadline("a", 4, declared_tokens_per_s=0.0, **args) == 120.0
    assert adm.late_after(4) == 0.0  # no fleet pace yet: nothing is late
    for pid in ("fast", "fast2", "fast3"):
        adm.on_result(pid, groups=10, issued_at=0.0, now=1.0)  # 10 groups/s, measured by the learner
    adm.on_result("slow", groups=4, issued_at=0.0, now=40.0)  # 0.1 groups/s
    adm.on_result("crawl", groups=1, issued_at=0.0, now=1000.0)
    # the median over the addresses is 10 groups/s: 4 prompts take the fleet 0.4 s, the deadline is
    # 4 × that at least lease_min_s, for the slow peer as for the fast (before: 160 s and 600 s)
    for pid in ("fast", "slow", "crawl", "new"):
        assert adm.deadline(pid, 4, declared_tokens_per_s=1e6, **args) == 2.0
    assert adm.late_after(4) == 1.0  # 2 × 0.4 s, at least half of lease_min_s
    # a slow peer is leased what it does in the fleet's time for a full lease
    assert adm.pace.sized("fast", 8) == 8 and adm.pace.sized("slow", 8) == 1
    # the staleness horizon bounds it too: 2 steps left at a 0.5 s step period
    adm.pace.note_version(0, 0.0)
    adm.pace.note_version(4, 2.0)
    assert adm.deadline("slow", 400, declared_tokens_per_s=0.0, steps_left=2, **args) == 2.0  # lease_min_s
    assert adm.deadline("slow", 400, declared_tokens_per_s=0.0, steps_left=100, **args) == 50.0
    assert adm.deadline("slow", 4000, declared_tokens_per_s=0.0, **args) == 600.0  # 20 × base


def test_the_fleet_s_reference_is_reused_until_a_result_or_an_expiry_lands(monkeypatch) -> None:
    """A lease asks for the reference rate up to three times and at 1,000 members each is ~1 ms:
    it is computed once per ``REFERENCE_TTL_S``, afresh as soon as a result or an expiry lands."""
    from echorl.learner import pace as pace_mod

    adm = _fleet()
    for pid in ("fast", "fast2", "fast3"):
        adm.on_result(pid, groups=10, issued_at=0.0, now=1.0)
    assert adm.pace.reference_rate() == pytest.approx(10.0)
    adm.load("fast").recent_s_per_group = 1.0  # behind the pace's back: not seen within the TTL
    adm.load("fast2").recent_s_per_group = 1.0
    assert adm.pace.reference_rate() == pytest.approx(10.0)
    clock = time.monotonic() + pace_mod.REFERENCE_TTL_S
    monkeypatch.setattr(pace_mod.time, "monotonic", lambda: clock)
    assert adm.pace.reference_rate() == pytest.approx(1.0)  # a second on: computed again
    adm.on_result("slow", groups=20, issued_at=0.0, now=1.0)  # lands: seen at once, same second
    assert adm.pace.reference_rate() == pytest.approx(5.5)  # the median of 1, 1, 10, 20
    adm.load("fast3").recent_s_per_group = 1.0
    adm.on_expired("fast3", now=2.0)
    assert adm.pace.reference_rate() == pytest.approx(1.0)


def test_a_large_fleet_is_ranked_at_most_every_fifth_of_a_millisecond_a_member(monkeypatch) -> None:
    """At 1,000 peers ranking the fleet after every result, and counting its proven peers and the
    room kept for them per lease request, was 15 % of the learner's loop: from
    ``RANK_AT_ONCE_UNDER`` members a change is ranked once the last ranking is
    ``RANK_S_PER_MEMBER`` × members old, and the room kept is what a scan of every member keeps."""
    from swarm import capability

    from echorl.learner import pace as pace_mod
    from echorl.learner.admission import Admission
    from echorl.learner.config import AdmissionFields
    from echorl.learner.peers import PeerBook

    clock = [time.monotonic()]
    monkeypatch.setattr(pace_mod.time, "monotonic", lambda: clock[0])
    n = 150
    book = PeerBook()
    adm = Admission(book, AdmissionFields())
    for i in range(n):
        book.join(f"p{i}", capability(), 0, ip=f"10.0.{i // 200}.{i % 200 + 1}")
        for _ in range(pace_mod.PROVEN_LEASES):  # every other one twice as fast
            adm.on_result(f"p{i}", groups=2 if i % 2 else 1, issued_at=clock[0] - 1.0, now=clock[0])
    clock[0] += pace_mod.REFERENCE_TTL_S  # a quiet second: ranked afresh
    first = adm.pace.ranking()
    assert len(first.proven) == n and first.members == n and n >= pace_mod.RANK_AT_ONCE_UNDER
    adm.newcomers.earned.clear()  # what their probation earned newcomers (newcomers.py), long expired
    assert adm.newcomers.budget(1000, 2, clock[0]) == 2 * math.ceil(n / 4)
    adm.on_result("p0", groups=8, issued_at=clock[0] - 1.0, now=clock[0])  # p0 is now the fastest
    assert adm.pace.ranking() is first  # a change waits for 150 × 0.2 ms
    clock[0] += pace_mod.RANK_S_PER_MEMBER * n * 1.01
    again = adm.pace.ranking()
    assert again is not first
    assert dict((p, r) for r, p in again.proven)["p0"] > dict((p, r) for r, p in first.proven)["p0"] == 1.0
    # the room kept for an asker: one lease for each faster proven peer holding none
    held = {f"p{i}": 1 for i in range(0, n, 4)}
    asker = "p2"  # a slow one: the fast ones and p0 ahead of it count
    mine = adm.load(asker).recent_per_s
    by_scan = sum(
        1 for i in range(n) if f"p{i}" != asker and adm.load(f"p{i}").recent_per_s > mine and held.get(f"p{i}", 0) == 0
    )
    assert adm.pace.reserved(asker, 2, clock[0], held) == 2 * by_scan > 0


def test_a_late_result_counts_like_an_expiry_and_resets_nothing() -> None:
    adm = _fleet(expiry_backoff_s=2.0, refuse_after_expiries=3)
    adm.on_result("fast", groups=10, issued_at=0.0, now=1.0)
    late = adm.late_after(8)
    assert late == pytest.approx(1.6)
    adm.on_result("slow", groups=8, issued_at=0.0, now=1.5, late_after_s=late)
    assert adm.leases_late == 0
    for k in range(1, 4):  # each late answer: another expiry in a row, a longer back-off
        adm.on_result("slow", groups=8, issued_at=10.0 * k, now=10.0 * k + 1.9, late_after_s=late)
        load = adm.load("slow")
        assert adm.leases_late == k
        assert load.expiries_in_row == k and load.backoff_until == pytest.approx(10.0 * k + 1.9 + 2.0 * 2 ** (k - 1))
    assert adm.refused("slow") and adm.leases_late == 3


def test_lease_deadline_adds_the_time_to_load_a_version_of_the_published_size() -> None:
    """A version published mid-lease is loaded before the lease's next sample: a 60 GB model's
    leases get 10 minutes more (at 100 MB/s), past the measured-rate cap; a 2 MB one 0.02 s."""
    adm = _fleet()
    args = dict(group_size=8, max_new_tokens=256, base_s=30.0, declared_tokens_per_s=0.0)
    adm.note_published(0, weights_bytes=2_000_000)
    assert adm.deadline("new", 4, **args) == pytest.approx(120.0 + 0.02)  # unmeasured: 4 × base + load
    adm.on_result("fast", groups=10, issued_at=0.0, now=1.0)
    assert adm.deadline("fast", 4, **args) == pytest.approx(2.0 + 0.02)
    adm.note_published(1)  # a delta: the model's size is unchanged
    assert adm.deadline("fast", 4, **args) == pytest.approx(2.02)
    adm.note_published(2, weights_bytes=60_000_000_000)
    assert adm.deadline("fast", 4, **args) == pytest.approx(2.0 + 600.0)
    assert adm.late_after(4) == pytest.approx(1.0 + 600.0)


def test_checkpointed_service_state_round_trips_and_bad_entries_are_skipped() -> None:
    """Flags, node addresses, accounts (the per-node credit, issue 28) and the receipt sequence
    survive a checkpoint; a re-joining node's record shares its restored account."""
    import json

    import pytest

    from echorl.tasks import load_task

    task = load_task("addition", digits=2, seed=0)

    def service() -> LearnerService:
        return LearnerService(
            Identity.generate(),
            "run-1",
            task,
            tokenizer=None,
            buffer=StalenessBuffer(4, scorer=task.reward),
            settings=ServiceFields(),
            vocab_size=100,
        )

    old = service()
    fresh = _record(FRESH, quiet_for_s=1.0)
    old.peers.add(replace(fresh, capability=fresh.capability.model_copy(update={"listen_addrs": [ADDR]})))
    old.peers.add(_record("gone-long-ago", quiet_for_s=3600.0))
    for _ in range(3):
        old.peers.count_mismatch("cheater")
    old.ledger.accept(FRESH, "L-1", 4, 3, 30, 0, 1)  # a receipt: 3 groups, 30 tokens
    old.ledger.reject(FRESH, "stale_version")
    old.peers.record_generation(FRESH, 4, 2.0, 1)
    saved = json.loads(json.dumps(old.state_dict()))  # what the checkpoint's state.json holds
    new = service()
    new.load_state_dict(saved)
    assert new.peers.remembered_addrs == {FRESH: [ADDR]}
    assert new.peers.mismatches == {"cheater": 3} and new.police.banned("cheater") and "cheater" in new.peers.flagged
    assert new.ledger.seq == 1 and new.ledger.peer_fields(FRESH) == old.ledger.peer_fields(FRESH)
    new.peers.add(_record(FRESH, quiet_for_s=0.0))  # the node re-joins the resumed learner
    assert (new.peers[FRESH].leases_done, new.peers[FRESH].groups_accepted) == (1, 3)
    assert new.peers[FRESH].rollouts_per_s == 2.0

    bad = service()
    good_account = saved["accounts"][FRESH]
    state = {
        "logprob_mismatches": {"a": 2, "b": "x", "c": True, "d": -1},
        "peer_addrs": {"p": ["/ip4/1.2.3.4/tcp/1"], "q": "x"},
        "accounts": {
            "ok": good_account,
            "neg": {**good_account, "groups_accepted": -1},
            "reason": {**good_account, "rejected": {"not_a_code": 1}},
            "extra": {**good_account, "surprise": 1},
            "nan": {**good_account, "cost": float("nan")},
        },
    }
    bad.load_state_dict(state)
    assert bad.peers.remembered_addrs == {"p": ["/ip4/1.2.3.4/tcp/1"]} and bad.peers.mismatches == {"a": 2}
    assert set(bad.peers.accounts) == {"ok"}
    fresh_svc = service()
    fresh_svc.load_state_dict({"logprob_mismatches": [1, 2], "peer_addrs": 7, "accounts": "x"})  # skipped
    assert fresh_svc.peers.remembered_addrs == {} and fresh_svc.peers.mismatches == {} and not fresh_svc.peers.accounts
    for junk in ("garbage", None, {"logprob_mismatches": {}, "bans": {"x": 1}}):  # not this code's state
        fresh_svc = service()
        with pytest.raises(ValueError, match="service state"):
            fresh_svc.load_state_dict(junk)
        assert fresh_svc.peers.remembered_addrs == {} and fresh_svc.peers.mismatches == {}


def test_status_is_paged_with_a_cursor() -> None:
    """``Status`` holds one page of peers and where the next starts; following the cursor lists
    every peer once, and the last page has no cursor."""
    from echorl.protocol import wire
    from echorl.protocol.messages import Status, StatusRequest
    from echorl.tasks import load_task

    task = load_task("addition", digits=2, seed=0)
    svc = LearnerService(
        Identity.generate(),
        "run-1",
        task,
        tokenizer=None,
        buffer=StalenessBuffer(4, scorer=task.reward),
        settings=ServiceFields(),
        vocab_size=100,
    )
    ids = [Identity.generate().peer_id for _ in range(7)]
    for pid in ids:
        svc.peers.add(_record(pid, quiet_for_s=0.0))

    async def page(cursor: int, limit: int) -> Status:
        req = wire.decode(wire.encode(StatusRequest(cursor=cursor, limit=limit)), expect=StatusRequest)
        reply = await svc.on_status(req, None)
        return wire.decode(wire.encode(reply), expect=Status)

    async def main() -> None:
        seen, cursor, pages = [], 0, 0
        while cursor is not None:
            st = await page(cursor, 3)
            assert len(st.peers) <= 3 and st.total_peers == 7
            seen += [p["peer_id"] for p in st.peers]
            cursor, pages = st.next_cursor, pages + 1
        assert seen == ids and pages == 3
        whole = await svc.on_status(StatusRequest(), None)  # no cursor: the first page
        assert len(whole.peers) == 7 and whole.next_cursor is None

    trio.run(main)


def test_work_is_billed_at_most_at_the_fleets_pace() -> None:
    """The seconds billed for an accepted lease are what it took, at most what the fleet takes for
    a lease of that size: answering slowly is never billed more (issue 24: cost from work)."""
    adm = _fleet()
    assert adm.on_result("first", groups=4, issued_at=0.0, now=8.0) == 8.0  # no pace yet: the time taken
    for pid in ("fast", "fast2", "fast3"):
        adm.on_result(pid, groups=10, issued_at=0.0, now=1.0)  # the fleet: 10 groups/s
    assert adm.on_result("fast", groups=4, issued_at=0.0, now=0.3) == pytest.approx(0.3)
    assert adm.on_result("slow", groups=4, issued_at=0.0, now=30.0) == pytest.approx(0.4)


def test_a_peer_a_little_slower_than_the_fleet_gets_full_leases() -> None:
    """Lease size follows the fleet with slack (SIZE_SLACK): against the fleet's median of 9
    groups/s, a peer at 8 still gets full leases (it finishes well before it would be late), one at
    5 gets 6 prompts of 8, one at 1 a single prompt (before: the peer at 8 was cut to 1 of 2)."""
    adm = _fleet()
    for pid in ("fast", "fast2", "fast3"):
        adm.on_result(pid, groups=10, issued_at=0.0, now=1.0)  # the fleet: 10 groups/s
    adm.on_result("near", groups=8, issued_at=0.0, now=1.0)  # 8 groups/s
    adm.on_result("half", groups=5, issued_at=0.0, now=1.0)
    adm.on_result("slow", groups=1, issued_at=0.0, now=1.0)
    assert [adm.pace.sized(p, 2) for p in ("near", "half", "slow")] == [2, 1, 1]
    assert [adm.pace.sized(p, 8) for p in ("near", "half", "slow")] == [8, 6, 1]


def test_a_crowd_of_unproven_identities_fills_only_what_proven_nodes_leave() -> None:
    """Room for proven peers' further leases (issue 24, slow_walker_32): two proven nodes each
    holding one of their two leases. A newcomer asking while no unproven peer holds a lease sees
    no room kept (it may prove itself); once one does, the next unproven asker sees both proven
    nodes' second leases kept, so a crowd of fresh identities cannot take them (before: room was
    kept only for a proven node holding no lease at all)."""
    adm = _fleet()
    for pid in ("fast", "fast2"):
        for _ in range(3):
            adm.on_result(pid, groups=8, issued_at=0.0, now=1.0)  # proven: 3 in a row on time
    held = {"fast": 1, "fast2": 1}
    assert adm.pace.reserved("new", 8, now=1.0, held=held, max_leases=2) == 0
    assert adm.pace.reserved("new", 8, now=1.0, held={**held, "slow": 1}, max_leases=2) == 2 * 8
    # an unproven asker in a crowd: each proven node's remaining leases
    assert adm.pace.reserved("slow", 8, now=1.0, held={"fast": 0, "fast2": 2, "crawl": 1}, max_leases=2) == 2 * 8
    # a proven asker keeps the old rule: one lease for each faster proven peer holding none
    for _ in range(3):
        adm.on_result("fast3", groups=16, issued_at=0.0, now=1.0)
    assert adm.pace.reserved("fast", 8, now=1.0, held={"fast": 1, "slow": 1}, max_leases=2) == 8
