"""Lease book of the learner: single-use lease ids, deadlines, per-peer ownership, replay guard.

A lease is issued to one peer for a list of prompts. It is settled exactly once (a result,
a refusal of that result, a return, or expiry); afterwards its id is remembered so a repeated
or late submission is refused (``replay`` if it was settled by a result, ``unknown_lease`` if
it expired or was returned). Submission nonces are remembered too (bounded memory). While one
submission for a lease is being checked (its spot check runs in a worker thread), a second one for
the same lease is refused at once (``replay``), so a node cannot make the learner check one lease's
work many times over.

How much work a node at version b may be leased is the run's ``StalenessRule``
(``rl/staleness.py``); for how long, ``learner/admission.py``.
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.tasks.base import Prompt

K = TypeVar("K")
V = TypeVar("V")


@dataclass
class LeaseRecord:
    lease_id: str
    peer_id: str
    prompts: list[Prompt]
    group_size: int
    min_version: int
    issued_at: float
    deadline: float
    late_after_s: float = 0.0  # a result later than this after issue counts against the peer (0: never)
    sampling_seed: int | None = None  # secret until the lease is sent: seeded sampling (actor/seeded.py); None: off
    address: str = ""  # the holder's address key at issue (net/hostkey.py:ip_key; "": unknown, not counted)


class LeaseBook:
    """The open leases (``active``, by id) with three indexes kept as leases are issued and
    settled: by holder, by the holder's address, and the prompts out in all. A lease request asks
    for them and the status lists every member's leases, so a scan of every open lease (or every
    holder) per request made a 1,000-peer swarm's control plane O(N^2) (bench/swarm.py)."""

    MAX_REMEMBERED = 200_000

    def __init__(self) -> None:
        self.active: dict[str, LeaseRecord] = {}
        self._by_peer: dict[str, dict[str, LeaseRecord]] = {}  # holder -> its open leases by id
        self._held: dict[str, int] = {}  # holder -> open leases (never 0: a holder with none is removed)
        self._at_address: dict[str, int] = {}  # address key -> open leases of its holders (never 0)
        self._prompts_out = 0  # prompts of all open leases
        self._settled: OrderedDict[str, str] = OrderedDict()  # lease id -> how it ended
        self._nonces: OrderedDict[bytes, None] = OrderedDict()
        self._checking: set[str] = set()  # leases a submission is being checked for
        self._counter = itertools.count()
        self._salt = secrets.token_hex(4)
        self.issued = 0
        self.expired = 0
        self.returned = 0

    def issue(
        self,
        peer_id: str,
        prompts: list[Prompt],
        group_size: int,
        min_version: int,
        now: float,
        timeout_s: float,
        late_after_s: float = 0.0,
        seeded: bool = True,
        address: str = "",
    ) -> LeaseRecord:
        """Open a lease; ``address``: the holder's address key (counted by :meth:`held_at`)."""
        lease_id = f"L{self._salt}-{next(self._counter)}"
        seed = secrets.randbits(63) if seeded else None  # unpredictable: a node cannot sample ahead of its lease
        rec = LeaseRecord(
            lease_id, peer_id, prompts, group_size, min_version, now, now + timeout_s, late_after_s, seed, address
        )
        self.active[lease_id] = rec
        self._by_peer.setdefault(peer_id, {})[lease_id] = rec
        self._held[peer_id] = self._held.get(peer_id, 0) + 1
        if address:
            self._at_address[address] = self._at_address.get(address, 0) + 1
        self._prompts_out += len(prompts)
        self.issued += 1
        return rec

    def check_nonce(self, nonce: bytes) -> None:
        if nonce in self._nonces:
            raise ProtocolError(ErrorCode.REPLAY, "nonce already used")

    def lookup(self, lease_id: str, peer_id: str) -> LeaseRecord:
        """The active lease ``lease_id`` held by ``peer_id``, or a refusal."""
        rec = self.active.get(lease_id)
        if rec is None:
            how = self._settled.get(lease_id)
            if how == "result":
                raise ProtocolError(ErrorCode.REPLAY, f"lease {lease_id} already settled")
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id} is {how or 'unknown'}")
        if rec.peer_id != peer_id:
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id} belongs to another peer")
        return rec

    def claim(self, lease_id: str) -> None:
        """Mark ``lease_id`` as being checked; a second submission for it meanwhile is refused."""
        if lease_id in self._checking:
            raise ProtocolError(ErrorCode.REPLAY, f"a submission for lease {lease_id} is being checked")
        self._checking.add(lease_id)

    def release(self, lease_id: str) -> None:
        """The check of ``lease_id``'s submission ended (accepted, refused or cancelled)."""
        self._checking.discard(lease_id)

    def settle(self, lease_id: str, how: str, nonce: bytes | None = None) -> LeaseRecord | None:
        rec = self.active.pop(lease_id, None)
        if rec is not None:
            mine = self._by_peer[rec.peer_id]
            del mine[lease_id]
            if mine:
                self._held[rec.peer_id] = len(mine)
            else:
                del self._by_peer[rec.peer_id], self._held[rec.peer_id]
            if rec.address:
                left = self._at_address[rec.address] - 1
                if left:
                    self._at_address[rec.address] = left
                else:
                    del self._at_address[rec.address]
            self._prompts_out -= len(rec.prompts)
        self._remember(self._settled, lease_id, how)
        if nonce is not None:
            self._remember(self._nonces, nonce, None)
        return rec

    def refuse(self, rec: LeaseRecord, nonce: bytes, how: str) -> bool:
        """Settle ``rec`` as refused (``how``) if it is still open (True: its prompts are to be
        re-queued); else only remember the nonce (it expired or was settled meanwhile)."""
        if self.active.get(rec.lease_id) is rec:
            self.settle(rec.lease_id, how, nonce)
            return True
        self._remember(self._nonces, nonce, None)
        return False

    def expire_due(self, now: float) -> list[LeaseRecord]:
        due = [r for r in self.active.values() if r.deadline <= now]
        for r in due:
            self.settle(r.lease_id, "expired")
        self.expired += len(due)
        return due

    def expire_peer(self, peer_id: str) -> list[LeaseRecord]:
        """Expire every lease of a peer found dead (before their deadline)."""
        gone = self.held_by(peer_id)
        for r in gone:
            self.settle(r.lease_id, "expired")
        self.expired += len(gone)
        return gone

    def return_leases(self, peer_id: str, lease_ids: list[str]) -> list[LeaseRecord]:
        out = []
        for lid in lease_ids:
            rec = self.active.get(lid)
            if rec is not None and rec.peer_id == peer_id:
                self.settle(lid, "returned")
                out.append(rec)
        self.returned += len(out)
        return out

    def held_by(self, peer_id: str) -> list[LeaseRecord]:
        """The peer's open leases, oldest first."""
        return list(self._by_peer.get(peer_id, {}).values())

    def held_per_peer(self) -> Mapping[str, int]:
        """Open leases by holder (holders only): a read-only view, current as leases change."""
        return MappingProxyType(self._held)

    def held_at(self, address: str) -> int:
        """Open leases whose holders' joins came from ``address`` (an address key)."""
        return self._at_address.get(address, 0)

    def outstanding_prompts(self) -> int:
        return self._prompts_out

    def metrics(self) -> dict[str, int]:
        return {"leases_active": len(self.active), "leases_expired": self.expired, "leases_issued": self.issued}

    def _remember(self, table: OrderedDict[K, V], key: K, value: V) -> None:
        table[key] = value
        while len(table) > self.MAX_REMEMBERED:
            table.popitem(last=False)
