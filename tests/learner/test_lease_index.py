"""The lease book's indexes (by holder, by address, prompts out) agree with its open leases through every way
a lease ends (issue 27: a lease request and the status read them instead of scanning every open
lease, which made a 1,000-peer control plane O(N^2))."""

from __future__ import annotations

import random

from echorl.learner.leases import LeaseBook
from echorl.tasks.base import Prompt


def _scan(book: LeaseBook) -> tuple[dict[str, int], int, dict[str, list[str]], dict[str, int]]:
    held: dict[str, int] = {}
    by_peer: dict[str, list[str]] = {}
    at: dict[str, int] = {}
    for r in book.active.values():
        held[r.peer_id] = held.get(r.peer_id, 0) + 1
        by_peer.setdefault(r.peer_id, []).append(r.lease_id)
        at[r.address] = at.get(r.address, 0) + 1
    return held, sum(len(r.prompts) for r in book.active.values()), by_peer, at


def test_the_indexes_follow_issue_settle_expire_and_return() -> None:
    rng = random.Random(7)
    book = LeaseBook()
    peers = [f"peer{i}" for i in range(40)]
    address = {p: f"198.18.0.{i % 7}" if i % 9 else "" for i, p in enumerate(peers)}  # "": unknown
    view = book.held_per_peer()  # a live view: read once, current ever after
    for step in range(3000):
        op, peer = rng.random(), rng.choice(peers)
        if op < 0.5 or not book.active:
            n = rng.randint(1, 4)
            prompts = [Prompt(f"p{step}-{j}", "x") for j in range(n)]
            book.issue(peer, prompts, 2, 0, float(step), rng.uniform(1, 50), address=address[peer])
        elif op < 0.7:
            book.settle(rng.choice(list(book.active)), "result", nonce=rng.randbytes(16))
        elif op < 0.8:
            book.expire_peer(peer)
        elif op < 0.9:
            book.return_leases(peer, [r.lease_id for r in book.held_by(peer)][:1])
        else:
            book.expire_due(float(step))
        held, out, by_peer, at = _scan(book)
        assert dict(view) == held and 0 not in view.values()
        assert book.outstanding_prompts() == out
        assert all([r.lease_id for r in book.held_by(p)] == by_peer.get(p, []) for p in peers)
        assert all(book.held_at(a) == at.get(a, 0) for a in set(address.values()) if a)
        assert book.held_at("") == 0  # an unknown address is never counted


def test_the_buffer_is_not_scanned_per_submission_while_the_batch_share_is_off() -> None:
    """``max_batch_share`` 1 (the default) binds nobody, so the buffer (B·S groups on a large run)
    is not listed per submission; with the share on, a lister gives what the list gives."""
    from echorl.learner.admission import Admission
    from echorl.learner.config import AdmissionFields
    from echorl.protocol import limits

    listed: list[int] = []

    def lister() -> list[str]:
        listed.append(1)
        return [f"p{i}" for i in range(24)]

    assert Admission(policy=AdmissionFields()).batch_room("a", lister, 8) == limits.MAX_PROMPTS_PER_LEASE
    assert not listed
    on = Admission(policy=AdmissionFields(max_batch_share=0.5))
    for i, pid in enumerate(lister()):
        on.note_contributor(pid, "abc"[i % 3])
    assert on.batch_room("a", lister, 8) == on.batch_room("a", lister(), 8) == 8
