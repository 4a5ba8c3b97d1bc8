"""The peer book (``learner/peers.py``): one ``forget`` clears a peer's membership (record, IP slot,
lease history: the admission loads were never pruned before) and keeps what the run holds
against it or owes it (flags, unanswered leases, its account); a re-join shares the kept account."""

from __future__ import annotations

from swarm import capability

from echorl.learner.admission import Admission
from echorl.learner.config import AdmissionFields
from echorl.learner.peers import PeerBook

IP = "203.0.113.7"


def test_forget_clears_membership_and_keeps_flags_refusals_and_credit():
    book = PeerBook()
    adm = Admission(book, AdmissionFields(refuse_after_expiries=1))
    for pid in ("idle", "worked", "flagged", "hoarder"):
        book.join(pid, capability(), 0, ip=IP)
        if pid == "hoarder":  # its lease expired unanswered: refused at once (refuse_after_expiries=1)
            adm.on_expired(pid, now=0.0)
        else:
            adm.on_result(pid, groups=1, issued_at=0.0, now=1.0)
    book.account("worked").credit(2, 2, 20)
    book.count_mismatch("flagged")
    assert book.members_from(IP) == 4 and set(book.loads) == {"idle", "worked", "flagged", "hoarder"}

    for pid in ("idle", "worked", "flagged", "hoarder"):
        book.forget(pid)
    assert len(book) == 0 and book.members_from(IP) == 0 and not book.is_member("idle")
    assert set(book.loads) == {"hoarder"} and adm.refused("hoarder")  # its refusal outlives a re-join
    assert book.mismatches == {"flagged": 1} and "flagged" in book.flagged
    assert book.accounts["worked"].groups_accepted == 2

    back = book.join("worked", capability(), 3, ip=IP)  # a re-join: the same account
    assert back.groups_accepted == 2 and back.is_worker and book.members_from(IP) == 1


def test_a_rejoin_from_another_address_moves_the_ip_slot():
    book = PeerBook()
    book.join("p", capability(), 0, ip=IP)
    book.join("p", capability(), 0, ip="198.51.100.1")
    assert book.members_from(IP) == 0 and book.members_from("198.51.100.1") == 1 and len(book) == 1
