"""Pay follows proof (issue 25, items 4 and 5): a proven cheat is convicted — its unverified
receipts voided in the ledger, its pending leases and buffered groups dropped, its address
remembered so that new identities from it are checked on every submission for a bounded time, and
all of it kept across a restart; a newcomer's first submissions are always checked; one address's
identities together hold at most one share of the buffer (learner/policing.py, peers.py,
ledger.py, resume.py, admission.py)."""

from __future__ import annotations

import json
import random
import time

import pytest
import trio
from swarm import capability

from echorl.actor.types import RolloutGroup, Sample
from echorl.learner.admission import Admission
from echorl.learner.config import AdmissionFields, ServiceFields
from echorl.learner.peers import CHEAT_ADDRESS_MEMORY_S, PeerBook, PeerRecord
from echorl.learner.policing import NEWCOMER_CHECKS
from echorl.learner.service import LearnerService
from echorl.protocol.errors import ErrorCode
from echorl.protocol.identity import Identity
from echorl.rl.buffer import StalenessBuffer
from echorl.tasks.base import Prompt

CHEAT, HONEST, NEIGHBOUR = (Identity.generate().peer_id for _ in range(3))


def _member(peer_id: str, ip: str, price: float = 0.0) -> PeerRecord:
    now = time.monotonic()
    return PeerRecord(peer_id, capability(price_per_hour=price), now, now, version=0, ip_key=ip)


def _service(spot=None) -> LearnerService:
    from echorl.tasks import load_task

    task = load_task("addition", digits=2, seed=0)
    return LearnerService(
        Identity.generate(),
        "run-1",
        task,
        None,
        StalenessBuffer(4, scorer=task.reward),
        ServiceFields(),
        100,
        spot=spot,
    )


def _group(prompt_id: str, token: int) -> RolloutGroup:
    samples = [Sample([token + k], [-0.1], "stop", "x") for k in range(2)]  # distinct: carries a signal
    return RolloutGroup(prompt_id, "prompt", [1, 2], samples, 0)


def _buffer_group(svc: LearnerService, peer_id: str, prompt_id: str) -> None:
    """A group of ``peer_id``'s accepted and waiting in the buffer for a batch."""
    svc.buffer.register([Prompt(prompt_id, "prompt")])
    svc.buffer.offer(_group(prompt_id, 3), 0, [1.0, 0.0])
    svc.admission.note_contributor(prompt_id, peer_id)


def _convicted_service() -> LearnerService:
    """A cheat at 10.0.0.7 with one verified and two unverified receipts (an hour's work at 2.0
    each), two groups buffered and a lease pending, beside an honest peer; then a failed replay."""
    svc = _service()
    svc.peers.add(_member(CHEAT, "10.0.0.7", price=2.0))
    svc.peers.add(_member(HONEST, "10.0.0.9", price=2.0))
    for k, verified in enumerate((True, False, False)):
        trio.run(svc.ledger.issue, CHEAT, f"L{k}", 1, [_group(f"c{k}", 5)], 0, 0, verified, 3600.0)
    trio.run(svc.ledger.issue, HONEST, "H0", 1, [_group("h0", 5)], 0, 0, False, 3600.0)
    for pid in ("c-a", "c-b"):
        _buffer_group(svc, CHEAT, pid)
    _buffer_group(svc, HONEST, "h-a")
    now = time.monotonic()
    pending = svc.leases.issue(CHEAT, [Prompt("c-pending", "prompt")], 2, 0, now, 60.0)
    svc.buffer.register(pending.prompts)
    refused = svc.leases.issue(CHEAT, [Prompt("c-refused", "prompt")], 2, 0, now, 60.0)
    svc.buffer.register(refused.prompts)
    svc.police.count_against(CHEAT, refused, b"n" * 16, ErrorCode.NOT_SAMPLED)
    return svc


def test_a_proven_cheat_loses_its_unverified_pay_pending_leases_and_buffered_groups() -> None:
    svc = _convicted_service()
    acc = svc.peers.accounts[CHEAT]
    assert (acc.submissions_accepted, acc.groups_accepted, acc.cost) == (1, 1, pytest.approx(2.0))  # the verified one
    assert (acc.submissions_voided, acc.groups_voided, acc.tokens_voided) == (2, 2, 4)
    assert acc.cost_voided == pytest.approx(4.0)
    row = svc.ledger.peer_fields(CHEAT)
    assert (row["groups_accepted_total"], row["groups_voided"], row["cost_voided"]) == (1, 2, 4.0)
    honest = svc.peers.accounts[HONEST]  # an unverified receipt of a peer not proven to cheat stands
    assert (honest.groups_accepted, honest.groups_voided, honest.cost) == (1, 0, pytest.approx(2.0))
    assert svc.buffer.buffered_ids() == ["h-a"]  # the cheat's waiting groups never reach a batch
    assert {p.prompt_id for p in svc.buffer.requeued} == {"c-a", "c-b", "c-pending", "c-refused"}
    assert not svc.leases.held_by(CHEAT)  # its pending submissions are refused (unknown_lease)
    assert (svc.police.counters["receipts_voided"], svc.police.counters["groups_purged"]) == (2, 2)
    from echorl.cli.ledger import from_status

    status = svc.status()  # the voided columns fit the status row; `echorl ledger` shows them
    rows = {r["peer_id"]: r for r in from_status({"run_id": status.run_id, "peers": status.peers})}
    assert (rows[CHEAT]["groups_accepted"], rows[CHEAT]["groups_voided"], rows[HONEST]["groups_voided"]) == (1, 2, 0)
    svc.police.convict(CHEAT)  # a second conviction voids nothing twice
    assert svc.peers.accounts[CHEAT].groups_voided == 2 and svc.police.counters["receipts_voided"] == 2


def test_a_cheats_address_makes_new_identities_suspect_for_a_bounded_time_without_banning() -> None:
    book = PeerBook()
    book.add(_member(CHEAT, "2001:db8:0:1::/64"))
    book.add(_member(NEIGHBOUR, "2001:db8:0:1::/64"))  # the same /64 (PeerBook keys by ip_key)
    book.add(_member(HONEST, "10.0.0.9"))
    t0 = 1_000_000.0
    assert not book.suspect(NEIGHBOUR, now=t0)
    assert book.remember_cheat(CHEAT, now=t0) == "2001:db8:0:1::/64"
    newcomer = Identity.generate().peer_id
    book.join(newcomer, capability(), 0, ip="2001:db8:0:1::beef")  # a fresh identity, same /64
    assert book.suspect(newcomer, now=t0 + 1) and book.suspect(NEIGHBOUR, now=t0 + 1)
    assert not book.suspect(HONEST, now=t0 + 1)
    assert newcomer not in book.flagged and not book.mismatches.get(NEIGHBOUR)  # checked, never banned
    assert not book.suspect(newcomer, now=t0 + CHEAT_ADDRESS_MEMORY_S + 1)  # bounded


def test_convictions_survive_a_restart() -> None:
    old = _convicted_service()
    saved = json.loads(json.dumps(old.state_dict()))
    new = _service()
    new.load_state_dict(saved)
    assert new.ledger.peer_fields(CHEAT) == old.ledger.peer_fields(CHEAT)
    assert new.peers.accounts[CHEAT].groups_voided == 2 and new.peers.accounts[CHEAT].unverified_groups == 0
    assert new.peers.accounts[HONEST].unverified_groups == 1  # still voidable after the restart
    sybil = Identity.generate().peer_id
    new.peers.join(sybil, capability(), 0, ip="10.0.0.7")
    assert new.peers.suspect(sybil)
    older = {**saved, "accounts": {HONEST: {k: v for k, v in saved["accounts"][HONEST].items() if "void" not in k}}}
    older["accounts"][HONEST] = {k: v for k, v in older["accounts"][HONEST].items() if "unverified" not in k}
    older.pop("cheat_addresses")
    pre = _service()
    pre.load_state_dict(older)  # a checkpoint of the code before: accounts read, nothing voidable
    assert pre.peers.accounts[HONEST].groups_accepted == 1 and pre.peers.accounts[HONEST].unverified_groups == 0


def _police(fraction: float, seed: int):
    import torch

    from echorl.learner.spot_check import SpotChecker

    rng = random.Random(seed)
    return _service(spot=SpotChecker(torch.nn.Linear(2, 2), None, 1.0, fraction, {}.get, rng=rng)).police  # type: ignore[arg-type]


def test_a_newcomers_first_submissions_are_all_checked_then_the_fraction() -> None:
    """A cheat from the start is caught on its first submission; after ``NEWCOMER_CHECKS``
    accepted ones the default fraction applies, drawn from the checker's RNG."""
    police, f, seed = _police(0.1, 7), 0.1, 7
    checked = []
    for _ in range(NEWCOMER_CHECKS + 200):  # every submission accepted
        checked.append(police.should_check(HONEST))
        police.book.account(HONEST).credit(1, 1, 1)
    assert checked[:NEWCOMER_CHECKS] == [True] * NEWCOMER_CHECKS
    rng = random.Random(seed)  # the first draws of the RNG decide the rest: none was used before
    assert checked[NEWCOMER_CHECKS:] == [rng.random() < f for _ in range(200)]
    assert 5 < sum(checked[NEWCOMER_CHECKS:]) < 40
    assert not any(_police(0.0, 7).should_check(HONEST) for _ in range(5))  # fraction 0: routine checks off


def test_many_identities_of_one_address_hold_at_most_its_share_of_the_buffer() -> None:
    """max_batch_share 0.5, batch 8: an honest peer has 4 groups buffered; 8 identities of one
    host (4 on one IPv4 address, 4 in one IPv6 /64) each offer 2 groups. Per identity each fits
    its share, so before the address bound they filled 16 of 20 buffered groups; per address
    each host's groups stay within half of the buffer."""

    def fill(ips: list[str]) -> tuple[int, int, int]:
        book = PeerBook()
        adm = Admission(book, AdmissionFields(max_batch_share=0.5))
        book.add(_member(HONEST, "10.0.0.9"))
        buffered = [f"h{i}" for i in range(4)]
        for pid in buffered:
            adm.note_contributor(pid, HONEST)
        for n, ip in enumerate(ips):
            sybil = f"sybil-{n}"
            book.join(sybil, capability(), 0, ip=ip)
            room = adm.batch_room(sybil, buffered, 8)
            for k in range(min(2, room)):
                buffered.append(f"s{n}-{k}")
                adm.note_contributor(buffered[-1], sybil)
        book.join("one-more", capability(), 0, ip=ips[0])
        book.join("elsewhere", capability(), 0, ip="10.0.0.10")
        return len(buffered) - 4, adm.batch_room("one-more", buffered, 8), adm.batch_room("elsewhere", buffered, 8)

    same_v4 = ["192.0.2.7"] * 8
    same_v6 = [f"2001:db8::{k + 1:x}" for k in range(8)]  # one /64
    for ips in (same_v4, same_v6):
        sybil_groups, same_host, other_host = fill(ips)
        assert sybil_groups == 4 and same_host == 0  # half of the 8 buffered: diluted, never replaced
        assert other_host == 8  # a peer of another address is bound only by its own share
    spread = [f"192.0.2.{k + 1}" for k in range(8)]  # 8 hosts: 8 shares (the per-identity bound only)
    assert fill(spread)[0] > 4
