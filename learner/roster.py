"""Who holds a membership slot and who is put in a broadcast plan: the learner's defence against a
Sybil flood (docs/threat-model.md). Peer IDs are free, so per-peer limits alone do not bound
what a thousand fresh identities cost; these rules bound it by what is not free:

* An address: at most ``max_peers_per_ip`` joined peers per IP address (an IPv6 address counts
  by its /64, what one host is usually given); a join beyond that is refused with
  ``peer_limit`` (``joins_refused_ip_cap``). A re-join of a member keeps its slot.
* Work: a broadcast plan holds the peers that have had a rollout accepted (most accepted groups
  first, at most ``plan_max_members`` in all) plus at most ``plan_newcomers`` peers that have
  not worked yet, the ones offered to fewest plans first, so every newcomer gets its turn and a
  newcomer that sits in plans without working yields its place (``plan_newcomers_capped``
  counts those left out; they still get every version by catch-up). The plan announcement is
  then bounded whatever joins, and encoded once per broadcast.
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
from dataclasses import dataclass
from typing import Any, Iterable

from echorl.net.guard import ip_key
from echorl.protocol.errors import ErrorCode, ProtocolError

log = logging.getLogger("echorl.learner.roster")

MAX_MEMBER_ADDRS = 8


@dataclass
class RosterPolicy:
    max_peers_per_ip: int = 32  # joined peers per IP address (IPv6: per /64); 0: no cap
    plan_newcomers: int = 16  # peers without accepted work in one broadcast plan
    plan_max_members: int = 1024  # peers in one broadcast plan, workers included
    idle_member_drop_s: float = 600.0  # a member that never worked is dropped this long after joining
    dead_member_drop_s: float = 60.0  # ... or this long after it stopped answering pings

    @classmethod
    def of(cls, policy: Any) -> "RosterPolicy":
        """The roster fields of a ``LeasePolicy`` (same names)."""
        return cls(**{f: getattr(policy, f) for f in cls.__dataclass_fields__ if hasattr(policy, f)})


def member_addrs(addrs: Iterable[str]) -> list[str]:
    """The listen addresses the learner keeps for a member (and puts in plans)."""
    return list(addrs)[:MAX_MEMBER_ADDRS]


class Roster:
    """Per-IP join slots, plan selection and the idle-member sweep over the service's ``peers``
    (records with ``joined_at``, ``last_seen``, ``alive``, ``leases_done``, ``groups_accepted``)."""

    def __init__(self, policy: RosterPolicy | None = None) -> None:
        self.policy = policy or RosterPolicy()
        self.ip_of: dict[str, str] = {}  # peer id -> ip key of its join
        self.per_ip: dict[str, int] = {}  # ip key -> joined peers
        self.offered: dict[str, int] = {}  # newcomer peer id -> plans it was put in
        self.refused: deque[str] = deque(maxlen=4096)  # refused joiners whose connection is to be closed
        self.counters = {"joins_refused_ip_cap": 0, "plan_newcomers_capped": 0, "members_dropped_idle": 0}

    # --- joins ----------------------------------------------------------------------------------
    def check_join(self, peer_id: str, ip: str | None) -> None:
        """Refuse (``peer_limit``) a new member from an address that already holds
        ``max_peers_per_ip`` members; a member's re-join always passes."""
        cap, key = self.policy.max_peers_per_ip, ip_key(ip)
        if cap <= 0 or not key or self.ip_of.get(peer_id) == key:
            return
        if self.per_ip.get(key, 0) >= cap:
            self.counters["joins_refused_ip_cap"] += 1
            self.refused.append(peer_id)
            raise ProtocolError(ErrorCode.PEER_LIMIT, f"{cap} peers from this address have joined already")

    def take_refused(self) -> list[str]:
        """Refused joiners since the last call (their connections are closed: a refused identity
        holds no connection, and its memory, on the learner)."""
        out = list(self.refused)
        self.refused.clear()
        return out

    def note_join(self, peer_id: str, ip: str | None) -> None:
        key = ip_key(ip)
        if self.ip_of.get(peer_id) == key:
            return
        self._release(peer_id)
        if key:
            self.ip_of[peer_id] = key
            self.per_ip[key] = self.per_ip.get(key, 0) + 1

    def forget(self, peer_id: str) -> None:
        self._release(peer_id)
        self.offered.pop(peer_id, None)

    def _release(self, peer_id: str) -> None:
        key = self.ip_of.pop(peer_id, None)
        if key is not None:
            left = self.per_ip.get(key, 1) - 1
            if left > 0:
                self.per_ip[key] = left
            else:
                self.per_ip.pop(key, None)

    # --- plans ----------------------------------------------------------------------------------
    @staticmethod
    def is_worker(peer: Any) -> bool:
        """A peer that has done work for this run (a settled lease or an accepted rollout)."""
        return peer.groups_accepted > 0 or peer.leases_done > 0

    def plan(self, candidates: list[Any]) -> list[Any]:
        """The members of the next broadcast plan out of the live ``candidates`` (see module doc)."""
        pol = self.policy
        workers = sorted((p for p in candidates if self.is_worker(p)),
                         key=lambda p: (-p.groups_accepted, p.joined_at))
        newcomers = sorted((p for p in candidates if not self.is_worker(p)),
                           key=lambda p: (self.offered.get(p.peer_id, 0), p.joined_at))
        room = max(0, pol.plan_max_members - min(len(workers), pol.plan_max_members))
        take = newcomers[:min(pol.plan_newcomers, room)]
        self.counters["plan_newcomers_capped"] += len(newcomers) - len(take)
        for p in take:
            self.offered[p.peer_id] = self.offered.get(p.peer_id, 0) + 1
        for p in workers:
            self.offered.pop(p.peer_id, None)
        return workers[:pol.plan_max_members] + take

    # --- idle members ---------------------------------------------------------------------------
    def idle(self, peers: dict[str, Any], busy: Iterable[str] = (), now: float | None = None) -> list[str]:
        """Members that never worked and either joined ``idle_member_drop_s`` ago or stopped
        answering ``dead_member_drop_s`` ago; ``busy`` (holding a lease, standby) are kept."""
        now = time.monotonic() if now is None else now
        pol, keep = self.policy, set(busy)
        out = []
        for pid, p in peers.items():
            if p.groups_accepted > 0 or p.leases_done > 0 or pid in keep:
                continue
            if now - p.joined_at > pol.idle_member_drop_s or (not p.alive and now - p.last_seen > pol.dead_member_drop_s):
                out.append(pid)
        return out

    def drop_idle(self, peers: dict[str, Any], busy: Iterable[str] = (), now: float | None = None) -> list[str]:
        """Remove :meth:`idle` members from ``peers`` (and their slots); returns their ids."""
        gone = self.idle(peers, busy, now)
        for pid in gone:
            peers.pop(pid, None)
            self.forget(pid)
        if gone:
            self.counters["members_dropped_idle"] += len(gone)
            log.info("dropped %d members that never worked", len(gone))
        return gone
