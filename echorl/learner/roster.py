"""Who holds a membership slot and who is put in a broadcast plan: the learner's defence against a
Sybil flood (docs/threat-model.md). Peer IDs are free, so per-peer limits alone do not bound
what a thousand fresh identities cost; these rules bound it by what is not free:

* An address: at most ``max_peers_per_ip`` joined peers per IP address (an IPv6 address counts
  by its /64, what one host is usually given). A join beyond that takes the slot of the
  address's member that has worked least recently among those that may be displaced
  (``members_displaced``; its connection is closed, it gets ``not_found`` and may join again):
  never a proven worker (its last ``PROVEN_LEASES`` leases answered in time, the last within
  ``WORK_RECENT_S``), a member holding a lease, or one within ``idle_member_drop_s`` of its
  first join (a newcomer's time to prove itself; a re-join does not restart it). With none to
  displace the join is refused with ``peer_limit`` (``joins_refused_ip_cap``). A re-join of a
  member keeps its slot. So honest peers behind one shared address (a carrier NAT, a campus)
  are not locked out by another's idle or barely working identities: a slot is kept by work.
* Work: a broadcast plan holds the peers that have had a rollout accepted (most accepted groups
  first, at most ``plan_max_members`` in all) plus at most ``plan_newcomers`` peers that have
  not worked yet, the ones offered to fewest plans first, so every newcomer gets its turn and a
  newcomer that sits in plans without working yields its place (``plan_newcomers_capped``
  counts those left out; they still get every version by catch-up). The plan announcement is
  then bounded whatever joins, and encoded once per broadcast. Only proven workers relay once
  one is proven: the rest are leaves.
* Time: a member that has never worked is dropped after ``idle_member_drop_s`` since its join,
  or ``dead_member_drop_s`` after it stopped answering (``members_dropped_idle``); an honest
  node that was dropped gets ``not_found`` on its next request and joins again.

Each member keeps at most ``MAX_MEMBER_ADDRS`` listen addresses (each ≤ ``limits.MAX_ADDR_BYTES``
at the wire), so one member costs a plan a few KiB at most.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from echorl.learner.config import RosterFields
from echorl.learner.pace import is_proven
from echorl.learner.peers import PeerBook, PeerRecord
from echorl.net.hostkey import ip_key
from echorl.protocol.errors import ErrorCode, ProtocolError

if TYPE_CHECKING:
    from echorl.broadcast.broadcaster import NodeInfo

log = logging.getLogger(__name__)

MAX_MEMBER_ADDRS = 8
WORK_RECENT_S = 600.0
"""A proven member keeps its slot against newcomers of its address while its last in-time answer
is this recent: the longest lease deadline by default (20 × the 30 s lease timeout), so a worker
waiting out a slow lease or a weight download is never displaced, an identity that stopped is."""


def member_addrs(addrs: Iterable[str]) -> list[str]:
    """The listen addresses the learner keeps for a member (and puts in plans)."""
    return list(addrs)[:MAX_MEMBER_ADDRS]


class Roster:
    """Per-IP join slots, plan selection and the idle-member sweep over the peer book (the book
    keeps each member's IP slot and plan count; the roster decides with them)."""

    def __init__(self, book: PeerBook, policy: RosterFields | None = None) -> None:
        self.book = book
        self.policy = policy if policy is not None else RosterFields()
        self.refused: deque[str] = deque(maxlen=4096)  # refused joiners whose connection is to be closed
        self.counters = {
            "joins_refused_ip_cap": 0,
            "members_displaced": 0,
            "plan_newcomers_capped": 0,
            "members_dropped_idle": 0,
        }

    def metrics(self) -> dict[str, int]:
        return dict(self.counters)

    # --- joins ----------------------------------------------------------------------------------
    def check_join(
        self, peer_id: str, ip: str | None, held: Mapping[str, int] | None = None, now: float | None = None
    ) -> None:
        """Admit a join: a member's re-join from the same address always passes; from an address
        that already holds ``max_peers_per_ip`` members the joiner takes the slot of the member
        :meth:`displaceable` names (``held``: open leases by holder), else ``peer_limit``."""
        cap, key = self.policy.max_peers_per_ip, ip_key(ip)
        member = self.book.get(peer_id)
        if cap <= 0 or not key or (member is not None and member.ip_key == key):
            return
        if self.book.members_from(ip) < cap:
            return
        victim = self.displaceable(key, held or {}, now)
        if victim is not None:
            self.book.forget(victim)
            self.refused.append(victim)  # its connection is closed; it may join again
            self.counters["members_displaced"] += 1
            log.info("%s displaced from a full address by a newcomer", victim[:16])
            return
        self.counters["joins_refused_ip_cap"] += 1
        self.refused.append(peer_id)
        raise ProtocolError(ErrorCode.PEER_LIMIT, f"{cap} peers from this address have joined already")

    def displaceable(self, key: str, held: Mapping[str, int], now: float | None = None) -> str | None:
        """The member from address ``key`` whose slot a newcomer may take (None: none may be
        displaced): not within ``idle_member_drop_s`` of its first join, holding no lease, not a
        proven worker that answered within ``WORK_RECENT_S``; of those, the one that answered
        in time least recently (never: first), the longest-joined first."""
        now = time.monotonic() if now is None else now
        grace, best, best_key = self.policy.idle_member_drop_s, None, (0.0, 0.0)
        for p in self.book.values():
            if p.ip_key != key or now - p.joined_at <= grace or held.get(p.peer_id, 0) > 0:
                continue
            load = self.book.loads.get(p.peer_id)
            worked = load.worked_at if load is not None else 0.0
            if self.proven(p.peer_id) and now - worked <= WORK_RECENT_S:
                continue
            rank = (worked, p.joined_at)
            if best is None or rank < best_key:
                best, best_key = p.peer_id, rank
        return best

    def take_refused(self) -> list[str]:
        """Refused joiners since the last call (their connections are closed: a refused identity
        holds no connection, and its memory, on the learner)."""
        out = list(self.refused)
        self.refused.clear()
        return out

    # --- plans ----------------------------------------------------------------------------------
    @staticmethod
    def is_worker(peer: PeerRecord) -> bool:
        """A peer that has done work for this run (an accepted submission)."""
        return peer.is_worker

    def plan(self, candidates: list[PeerRecord]) -> list[PeerRecord]:
        """The members of the next broadcast plan out of the live ``candidates`` (see module doc)."""
        pol = self.policy
        workers = sorted((p for p in candidates if p.is_worker), key=lambda p: (-p.groups_accepted, p.joined_at))
        newcomers = sorted((p for p in candidates if not p.is_worker), key=lambda p: (p.plans_offered, p.joined_at))
        room = max(0, pol.plan_max_members - min(len(workers), pol.plan_max_members))
        take = newcomers[: min(pol.plan_newcomers, room)]
        self.counters["plan_newcomers_capped"] += len(newcomers) - len(take)
        for p in take:
            p.offered_a_plan()
        return workers[: pol.plan_max_members] + take

    def proven(self, peer_id: str) -> bool:
        """Its last ``PROVEN_LEASES`` leases were answered in time (``learner/pace.py``)."""
        return is_proven(self.book.loads.get(peer_id))

    def broadcast_nodes(self, live: list[PeerRecord]) -> list[NodeInfo]:
        """The nodes a version is broadcast to: the ``plan`` of the ``live`` members (alive, heard
        from recently). Once some worker is proven, only proven workers relay and the rest are
        leaves (before that: every worker): an identity that worked once relays nothing to others,
        so a crowd that answered one lease each and left at once (32 slow-walkers at the end of a
        bench window) cuts no honest node's stripes (their recovery had held training 10 s)."""
        from echorl.broadcast.broadcaster import NodeInfo

        chosen = self.plan(live)
        relays = {p.peer_id for p in chosen if p.is_worker and self.proven(p.peer_id)}
        relays = relays or {p.peer_id for p in chosen if p.is_worker}
        return [
            NodeInfo(
                p.peer_id,
                bool(p.capability.reachable),
                tuple(p.capability.listen_addrs),
                leaf=bool(relays) and p.peer_id not in relays,
            )
            for p in chosen
        ]

    # --- idle members ---------------------------------------------------------------------------
    def idle(self, busy: Iterable[str] = (), now: float | None = None) -> list[str]:
        """Members that never worked and either joined ``idle_member_drop_s`` ago or stopped
        answering ``dead_member_drop_s`` ago; ``busy`` (holding a lease, standby) are kept."""
        now = time.monotonic() if now is None else now
        pol, keep = self.policy, set(busy)
        out = []
        for p in self.book.values():
            if p.is_worker or p.peer_id in keep:
                continue
            if now - p.joined_at > pol.idle_member_drop_s or (
                not p.alive and now - p.last_seen > pol.dead_member_drop_s
            ):
                out.append(p.peer_id)
        return out

    def drop_idle(self, busy: Iterable[str] = (), now: float | None = None) -> list[str]:
        """Forget the :meth:`idle` members (``PeerBook.forget``); returns their ids."""
        gone = self.idle(busy, now)
        for pid in gone:
            self.book.forget(pid)
        if gone:
            self.counters["members_dropped_idle"] += len(gone)
            log.info("dropped %d members that never worked", len(gone))
        return gone
