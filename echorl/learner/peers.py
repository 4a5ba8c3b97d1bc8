"""The peer book: every fact the learner keeps about a peer, by peer id, with one owner.

- :class:`PeerRecord`: a joined member (capability, when it joined and was last heard from, its
  version, the address its join came from, its process ``instance``, broadcast plans it was put
  in as a newcomer). A re-join replaces it (keeping its first join's time and plan count);
  :meth:`PeerBook.forget` removes it.
- :class:`PeerLoad`: the learner's own measurement of the peer's leases (issue → accepted
  result), expiries in a row and the back-off they earned (``learner/admission.py`` decides
  with it).
- :class:`PeerAccount`: the peer's credit and work history: accepted submissions, groups and
  tokens (each answered with a signed receipt, ``learner/ledger.py``), rejections by reason,
  generation time, time joined and cost. It outlives re-joins and, through the learner's
  checkpoint, a restart (``learner/resume.py``): the learner's per-node figures equal the
  node's receipts.
- Flags: spot-check mismatch counts (a ban at ``spot_check_ban_after``) and the flagged set
  (every submission of a flagged peer is spot-checked); the addresses a proven cheat joined from,
  for ``CHEAT_ADDRESS_MEMORY_S`` (every identity from one is a ``suspect``: all checked, none banned).
- Addresses: each member's listen addresses (its capability), its join's IP slot (at most
  ``max_peers_per_ip`` members per address, ``learner/roster.py``), and the addresses of the
  nodes a resumed learner re-dials.

:meth:`PeerBook.forget` is the one way a peer leaves: its record, IP slot and lease history go;
what the run holds against it (flags, and a load with unanswered leases: back-off or refusal)
and what it is owed (its account) stay, so neither a ban nor credit is lost by a re-join.
Accounts are bounded (``MAX_ACCOUNTS``): a peer beyond that works with an account the book does
not keep, counted as ``peers_untracked``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from echorl.net.hostkey import ip_key
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import Capability

MAX_ACCOUNTS = 4096
"""Peers whose credit the ledger keeps (a closed set of rejection reasons each: bounded)."""
ACTIVE_WINDOW_S = 30.0
"""A member heard from within this long (and alive) is active: counted, leased, planned."""
SECONDS_PER_HOUR = 3600.0
CHEAT_ADDRESS_MEMORY_S = 24 * 3600.0
"""How long the address (IPv4, IPv6 /64) a proven cheat joined from stays suspect: every identity
from it has each submission checked, none is refused, so an honest peer behind the same NAT or /64
works on at the price of a check per submission. Identities are free, so a cheater re-joins at once
under a new key: a day outlasts that loop many times over, while an address a home ISP or a cloud
re-assigns does not carry the stain for ever (its next holder pays a bounded cost)."""
MAX_CHEAT_ADDRESSES = 4096
"""Suspect addresses kept (the ones expiring soonest give way): bounded like the accounts."""


@dataclass
class PeerAccount:
    """A peer's credit and work history (kept across re-joins and restarts)."""

    submissions_accepted: int = 0
    groups_accepted: int = 0
    groups_dropped: int = 0  # submitted in an accepted submission but refused by the buffer
    tokens_accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason (ErrorCode value) -> submissions
    generate_seconds: float = 0.0  # generation time of accepted submissions (floored, admission.py)
    groups_generated: int = 0  # groups of accepted submissions
    joined_s: float = 0.0  # time joined and alive
    cost: float = 0.0  # Σ price × seconds of accepted work (Ledger.issue)
    # the part of the above whose receipts were not verified by a replay: voided if the peer is
    # proven to cheat (``void_unverified``), then counted under the voided columns instead
    unverified_submissions: int = 0
    unverified_groups: int = 0
    unverified_tokens: int = 0
    unverified_cost: float = 0.0
    submissions_voided: int = 0
    groups_voided: int = 0
    tokens_voided: int = 0
    cost_voided: float = 0.0

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def top_rejection(self) -> str | None:
        return max(self.rejected, key=lambda k: self.rejected[k]) if self.rejected else None

    @property
    def rollouts_per_s(self) -> float:
        """Measured rollout-group throughput while generating (μ_i of the capacity model)."""
        return self.groups_generated / self.generate_seconds if self.generate_seconds > 0 else 0.0

    def credit(self, submitted: int, groups: int, tokens: int, verified: bool = False) -> None:
        """An accepted submission: ``groups`` of ``submitted`` went into the buffer; not
        ``verified`` (its receipt says so), it stays voidable."""
        self.submissions_accepted += 1
        self.groups_accepted += groups
        self.groups_dropped += submitted - groups
        self.tokens_accepted += tokens
        if not verified:
            self.unverified_submissions += 1
            self.unverified_groups += groups
            self.unverified_tokens += tokens

    def void_unverified(self) -> int:
        """The peer is proven to cheat: its receipts that no replay verified stop counting (their
        groups, tokens and billed cost move to the voided columns); verified ones stand. Returns
        the receipts voided."""
        n = self.unverified_submissions
        self.submissions_accepted -= n
        self.groups_accepted -= self.unverified_groups
        self.tokens_accepted -= self.unverified_tokens
        self.cost = max(0.0, self.cost - self.unverified_cost)
        self.submissions_voided += n
        self.groups_voided += self.unverified_groups
        self.tokens_voided += self.unverified_tokens
        self.cost_voided += self.unverified_cost
        self.unverified_submissions = self.unverified_groups = self.unverified_tokens = 0
        self.unverified_cost = 0.0
        return n

    def generated(self, groups: int, seconds: float) -> None:
        """The generation an accepted submission took (its throughput measurement)."""
        self.groups_generated += groups
        self.generate_seconds += seconds

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def alive_for(self, seconds: float) -> None:
        """``seconds`` more joined and alive."""
        self.joined_s += max(0.0, seconds)

    def bill(self, seconds: float, price_per_hour: float, verified: bool = False) -> None:
        """``seconds`` of accepted work at ``price_per_hour`` (time joined is not billed); not
        ``verified``, the amount stays voidable."""
        amount = max(0.0, price_per_hour) * max(0.0, seconds) / SECONDS_PER_HOUR
        self.cost += amount
        if not verified:
            self.unverified_cost += amount


@dataclass
class PeerRecord:
    """A joined member; its work counts live in its ``account`` (which outlives the record)."""

    peer_id: str
    capability: Capability
    joined_at: float
    last_seen: float
    version: int = -1
    alive: bool = True
    ip_key: str = ""  # the address its join came from (IPv6: its /64); "" unknown
    instance: bytes = b""  # its node process (one live process per key, learner/membership.py)
    plans_offered: int = 0  # broadcast plans it was put in before it worked (learner/roster.py)
    account: PeerAccount = field(default_factory=PeerAccount)

    @property
    def leases_done(self) -> int:
        return self.account.submissions_accepted

    @property
    def groups_accepted(self) -> int:
        return self.account.groups_accepted

    @property
    def groups_generated(self) -> int:
        return self.account.groups_generated

    @property
    def rollouts_per_s(self) -> float:
        return self.account.rollouts_per_s

    def status_fields(self, now: float) -> dict[str, Any]:
        """The record's own columns of the status reply's peer row (the service adds the others')."""
        c = self.capability
        return {
            "peer_id": self.peer_id,
            "device": c.device,
            "engine": c.engine,
            "version": self.version,
            "tokens_per_s": round(c.tokens_per_s, 1),
            "price_per_hour": c.price_per_hour,
            "leases_done": self.leases_done,
            "groups_accepted": self.groups_accepted,
            "rollouts_per_s": round(self.rollouts_per_s, 3),
            "last_seen_s": round(now - self.last_seen, 2),
            "alive": self.alive,
            "reachable": c.reachable,
        }

    def offered_a_plan(self) -> None:
        """Put in a broadcast plan before it worked (newcomers offered fewest plans go first)."""
        self.plans_offered += 1

    @property
    def is_worker(self) -> bool:
        """A peer that has done work for this run (an accepted submission)."""
        return self.account.groups_accepted > 0 or self.account.submissions_accepted > 0


RECENT_WEIGHT = 0.5
"""Weight of the newest lease in a peer's recent seconds per group: a peer that turns slow
(a slow-walker after its one fast answer) is ranked slow after one or two leases."""


@dataclass
class PeerLoad:
    """The learner's own view of one peer's lease history (every time on the learner's clock)."""

    measured_groups: int = 0
    measured_seconds: float = 0.0
    expiries_in_row: int = 0  # leases in a row that expired, came back late or came back stale
    backoff_until: float = 0.0
    recent_s_per_group: float = 0.0  # moving average over its answered leases (0: none yet)
    on_time_in_row: int = 0  # leases in a row answered in time (learner/pace.py: proven peers)
    worked_at: float = 0.0  # when its last lease was answered in time (0: never; learner/roster.py)
    not_before: float = 0.0  # the end of the last retry_after_s it was given (learner/admission.py)
    early_asks: int = 0  # lease requests before their not_before since early_since (learner/admission.py)
    early_since: float = 0.0

    @property
    def groups_per_s(self) -> float:
        """Groups per second from lease issue to accepted result (0: not measured yet)."""
        return self.measured_groups / self.measured_seconds if self.measured_seconds > 0 else 0.0

    @property
    def recent_per_s(self) -> float:
        """Groups per second over its recent leases (issue → accepted result; 0: not measured)."""
        return 1.0 / self.recent_s_per_group if self.recent_s_per_group > 0 else 0.0

    def _measure(self, groups: int, seconds: float) -> None:
        self.measured_groups += groups
        self.measured_seconds += seconds
        per = seconds / max(1, groups)
        old = self.recent_s_per_group
        self.recent_s_per_group = per if old <= 0 else RECENT_WEIGHT * per + (1 - RECENT_WEIGHT) * old

    def answered(self, groups: int, seconds: float) -> None:
        """A lease answered in time with ``groups`` accepted, ``seconds`` after it was issued."""
        self._measure(groups, seconds)
        self.expiries_in_row = 0
        self.on_time_in_row += 1
        self.backoff_until = 0.0

    def late(self, groups: int, seconds: float, now: float, backoff_s: float, backoff_max_s: float) -> None:
        """A lease answered, but later than the fleet's pace allows: measured (it ranks the peer at
        this lease's rate at once, not averaged with a fast opening) and counted like an expiry
        (back-off; ``expiries_in_row`` goes on, it is not reset)."""
        self._measure(groups, seconds)
        self.recent_s_per_group = max(self.recent_s_per_group, seconds / max(1, groups))  # slow at once
        self.expired(now, backoff_s, backoff_max_s)

    def expired(self, now: float, backoff_s: float, backoff_max_s: float) -> None:
        """A lease expired unanswered (or came back late or stale): the k-th in a row backs the
        peer off ``backoff_s``·2^(k−1) (at most ``backoff_max_s``)."""
        self.expiries_in_row += 1
        self.on_time_in_row = 0
        wait = min(backoff_s * 2 ** (self.expiries_in_row - 1), backoff_max_s)
        self.backoff_until = max(self.backoff_until, now + wait)


class PeerBook:
    """Every per-peer map of the learner (see the module docstring). Iterating, ``in``, ``[]``,
    ``get`` and ``len`` are over the joined members."""

    def __init__(self) -> None:
        self._members: dict[str, PeerRecord] = {}
        self._per_ip: dict[str, int] = {}  # ip key -> joined members from it
        self.loads: dict[str, PeerLoad] = {}
        self.accounts: dict[str, PeerAccount] = {}
        self.mismatches: dict[str, int] = {}  # spot-check / replay mismatches (flags survive re-joins)
        self.flagged: set[str] = set()  # every submission of these is spot-checked
        self.cheat_addrs: dict[str, float] = {}  # ip key -> until when (wall clock) it is suspect
        self.remembered_addrs: dict[str, list[str]] = {}  # nodes of a checkpoint, to re-dial
        self.untracked = 0  # peers beyond MAX_ACCOUNTS (their accounts are not kept)

    # --- members ------------------------------------------------------------------------------
    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._members

    def __getitem__(self, peer_id: str) -> PeerRecord:
        return self._members[peer_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def is_member(self, peer_id: str) -> bool:
        """Whether the peer joined (and was not forgotten): its requests' bodies are read."""
        return peer_id in self._members

    def get(self, peer_id: str) -> PeerRecord | None:
        return self._members.get(peer_id)

    def values(self) -> list[PeerRecord]:
        return list(self._members.values())

    def join(
        self, peer_id: str, capability: Capability, version: int, ip: str | None = None, instance: bytes = b""
    ) -> PeerRecord:
        """Make (or replace, on a re-join) a member's record; a re-join keeps its plan count and
        its first join's time (a re-join does not restart the time a newcomer is given to work,
        ``learner/roster.py``)."""
        now = time.monotonic()
        old = self._members.get(peer_id)
        rec = PeerRecord(
            peer_id,
            capability,
            old.joined_at if old is not None else now,
            now,
            version,
            ip_key=ip_key(ip),
            instance=instance or (old.instance if old is not None else b""),
            plans_offered=old.plans_offered if old is not None else 0,
        )
        return self.add(rec)

    def add(self, rec: PeerRecord) -> PeerRecord:
        """Put ``rec`` in the book (replacing the peer's record): it takes over the IP slot and
        shares the peer's kept account."""
        self._release(rec.peer_id)
        rec.account = self._account_for(rec.peer_id, rec.account)
        self._members[rec.peer_id] = rec
        if rec.ip_key:
            self._per_ip[rec.ip_key] = self._per_ip.get(rec.ip_key, 0) + 1
        return rec

    def touch(self, peer_id: str, version: int | None = None) -> PeerRecord:
        """A member's request: heard from now, alive (at ``version``, if it says); ``not_found``
        if it is not a member."""
        rec = self._members.get(peer_id)
        if rec is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "not joined: send a join request first")
        rec.last_seen = time.monotonic()
        rec.alive = True
        if version is not None:
            rec.version = version
        return rec

    def heard(self, peer_id: str) -> None:
        """A member answered a ping."""
        rec = self._members.get(peer_id)
        if rec is not None:
            rec.last_seen = time.monotonic()

    def mark_dead(self, peer_id: str) -> bool:
        """A member failed its liveness probe (False: not a member any more)."""
        rec = self._members.get(peer_id)
        if rec is None:
            return False
        rec.alive = False
        return True

    def record_generation(self, peer_id: str, groups: int, seconds: float, version: int) -> None:
        """An accepted submission's generation: the peer's throughput measurement and version."""
        self.account(peer_id).generated(groups, seconds)
        rec = self._members.get(peer_id)
        if rec is not None:
            rec.version = max(rec.version, version)

    def members_from(self, ip: str | None) -> int:
        """Members whose join came from ``ip``'s address (IPv6: its /64)."""
        return self._per_ip.get(ip_key(ip), 0)

    def address_of(self, peer_id: str) -> str:
        """The key its join's address counts under (IPv6: the /64); its own id if not known: a
        peer whose address is unknown counts as an address of its own."""
        rec = self._members.get(peer_id)
        return rec.ip_key if rec is not None and rec.ip_key else peer_id

    def active(self, window_s: float = ACTIVE_WINDOW_S, now: float | None = None) -> list[PeerRecord]:
        """Alive members heard from within ``window_s``."""
        return list(self._active(window_s, now))

    def has_active(self, window_s: float = ACTIVE_WINDOW_S) -> bool:
        """Whether any member is :meth:`active` (stops at the first: asked per sampling request)."""
        return any(True for _ in self._active(window_s, None))

    def _active(self, window_s: float, now: float | None) -> Iterator[PeerRecord]:
        now = time.monotonic() if now is None else now
        return (p for p in self._members.values() if p.alive and now - p.last_seen < window_s)

    def forget(self, peer_id: str) -> None:
        """The one way a peer leaves (see the module docstring): its record, IP slot and lease
        history go; its flags, a load with unanswered leases, and its account stay."""
        self._release(peer_id)
        self._members.pop(peer_id, None)
        load = self.loads.get(peer_id)
        if load is not None and load.expiries_in_row == 0:
            del self.loads[peer_id]

    def _release(self, peer_id: str) -> None:
        old = self._members.get(peer_id)
        if old is not None and old.ip_key:
            left = self._per_ip.get(old.ip_key, 1) - 1
            if left > 0:
                self._per_ip[old.ip_key] = left
            else:
                self._per_ip.pop(old.ip_key, None)

    # --- loads, accounts, flags ---------------------------------------------------------------
    def load(self, peer_id: str) -> PeerLoad:
        rec = self.loads.get(peer_id)
        if rec is None:
            rec = self.loads[peer_id] = PeerLoad()
        return rec

    def measured_rate(self, peer_id: str) -> float:
        """Groups per second of the peer's recent leases, issue → accepted result on the learner's
        clock (0: not measured): never what the node reports about itself."""
        load = self.loads.get(peer_id)
        return load.recent_per_s if load is not None else 0.0

    def account(self, peer_id: str) -> PeerAccount:
        """The peer's account to count on: the member's, a kept one, or a new one (kept while
        there is room)."""
        member = self._members.get(peer_id)
        return member.account if member is not None else self._account_for(peer_id, PeerAccount())

    def find_account(self, peer_id: str) -> PeerAccount | None:
        """The peer's account, to read (None: none kept and not a member)."""
        member = self._members.get(peer_id)
        return member.account if member is not None else self.accounts.get(peer_id)

    def _account_for(self, peer_id: str, fresh: PeerAccount) -> PeerAccount:
        kept = self.accounts.get(peer_id)
        if kept is not None:
            return kept
        if len(self.accounts) < MAX_ACCOUNTS:
            self.accounts[peer_id] = fresh
        else:
            self.untracked += 1
        return fresh

    def flag(self, peer_id: str) -> None:
        """From now on every submission of the peer is spot-checked."""
        self.flagged.add(peer_id)

    def count_mismatch(self, peer_id: str) -> int:
        """One more forged submission (log-probs or an episode): flagged; the count so far."""
        n = self.mismatches.get(peer_id, 0) + 1
        self.mismatches[peer_id] = n
        self.flag(peer_id)
        return n

    def remember_cheat(self, peer_id: str, now: float | None = None) -> str:
        """A proven cheat: the address its join came from is suspect for ``CHEAT_ADDRESS_MEMORY_S``
        (the key; "" if its address is not known)."""
        rec = self._members.get(peer_id)
        key = rec.ip_key if rec is not None else ""
        if key:
            now = time.time() if now is None else now
            self.cheat_addrs[key] = now + CHEAT_ADDRESS_MEMORY_S
            self._bound_cheat_addrs(now)
        return key

    def _bound_cheat_addrs(self, now: float) -> None:
        self.cheat_addrs = {k: t for k, t in self.cheat_addrs.items() if t > now}
        while len(self.cheat_addrs) > MAX_CHEAT_ADDRESSES:
            del self.cheat_addrs[min(self.cheat_addrs, key=self.cheat_addrs.__getitem__)]

    def suspect(self, peer_id: str, now: float | None = None) -> bool:
        """Whether every submission of the peer is checked: it is flagged, or it joined from an
        address a proven cheat joined from within ``CHEAT_ADDRESS_MEMORY_S``."""
        if peer_id in self.flagged:
            return True
        rec = self._members.get(peer_id)
        until = self.cheat_addrs.get(rec.ip_key, 0.0) if rec is not None and rec.ip_key else 0.0
        return until > (time.time() if now is None else now)

    def restore_flags(
        self, mismatches: dict[str, int], addrs: dict[str, list[str]], cheat_addrs: dict[str, float] | None = None
    ) -> None:
        """A checkpoint's flags (each counted peer flagged again), suspect addresses and the nodes
        to re-dial."""
        self.mismatches = dict(mismatches)
        self.flagged |= set(mismatches)
        self.remembered_addrs = dict(addrs)
        self.cheat_addrs.update(cheat_addrs or {})
        self._bound_cheat_addrs(time.time())

    def restore_accounts(self, accounts: dict[str, PeerAccount]) -> None:
        """A checkpoint's accounts (a member's record shares its restored account)."""
        for peer_id, acc in list(accounts.items())[:MAX_ACCOUNTS]:
            self.accounts[peer_id] = acc
            member = self._members.get(peer_id)
            if member is not None:
                member.account = acc

    # --- figures ------------------------------------------------------------------------------
    def metrics(self) -> dict[str, object]:
        """The members' part of a metrics row: active nodes, their measured throughput, and per
        member its accepted and generated groups and version (labelled by short id)."""
        active, members = self.active(), self._members.values()
        return {
            "nodes_active": len(active),
            "available_rollouts_per_s": sum(p.rollouts_per_s for p in active),
            "per_node_rollouts_per_s": {short_id(p.peer_id): round(p.rollouts_per_s, 3) for p in active},
            "per_node_groups": {short_id(p.peer_id): p.groups_accepted for p in members},
            "per_node_groups_generated": {short_id(p.peer_id): p.groups_generated for p in members},
            "per_node_version": {short_id(p.peer_id): p.version for p in members},
        }
