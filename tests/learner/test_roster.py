"""Who relays a version: the roster's broadcast plan over the peer book."""

from __future__ import annotations

from swarm import capability

from echorl.learner.pace import PROVEN_LEASES
from echorl.learner.peers import PeerBook
from echorl.learner.roster import Roster
from echorl.protocol.identity import Identity


def test_once_a_worker_is_proven_only_proven_workers_relay() -> None:
    """Issue 24: 32 slow-walkers had each had one lease accepted (their fast opening), so they
    were workers and relayed stripes to the honest nodes; when they left at once, the honest
    nodes' recovery held training 10 s. Once one worker is proven, a worker that is not is a leaf
    like a newcomer; before anyone is proven, every worker relays (a run's first plans)."""
    book = PeerBook()
    honest, walker, newcomer = (Identity.generate().peer_id for _ in range(3))
    for i, pid in enumerate((honest, walker, newcomer)):
        book.join(pid, capability(), 0, f"10.0.0.{i + 1}")
    for pid in (honest, walker):
        book.account(pid).credit(1, 1, 4, False)  # one accepted group each: both are workers
    roster = Roster(book)

    def leaves() -> set[str]:
        return {n.peer_id for n in roster.broadcast_nodes(book.active()) if n.leaf}

    assert leaves() == {newcomer}  # nobody proven yet: both workers relay
    book.load(honest).on_time_in_row = PROVEN_LEASES
    assert leaves() == {walker, newcomer}  # before: only the newcomer
