"""The fleet's pace: how long a lease may take, judged by the whole fleet and the run, never by
the peer that holds it (docs/threat-model.md, "slow-walking lease hoarder").

A slow-walker answers its first lease at once (so the learner measures it) and every later one
just before its deadline: if deadlines grew from the peer's own measured rate and any accepted
answer wiped its record, a few identities would hold the whole in-flight budget for minutes each
and win every freed slot by polling. So:

- **Proven** peers answered their last ``PROVEN_LEASES`` leases in time: one fast answer (the
  slow-walker's opening) proves nothing.
- **Reference rate**: for each address (an IPv4 address, an IPv6 /64) the best recent
  learner-measured rate (lease issue → accepted result) among its live proven members; the
  reference is the median over addresses (before anyone is proven: over every measured member).
  Identities from one host count once, and a peer can raise its own rate only by returning
  accepted work faster.
- **Expected time** of a lease of ``n`` prompts: ``n`` / reference (0: no one measured yet).
- **Deadline** (``Admission.deadline``): ``DEADLINE_FACTOR`` × the expected time, at least
  ``lease_min_s``, at most 20 × the base timeout and the **staleness horizon** (the steps until
  the lease's version goes stale × the learner's recent step period).
- **Late**: a result after ``LATE_FACTOR`` × the expected time (and half of ``lease_min_s``) is
  accepted if it passes every check, and counts against the peer like an expiry (back-off; it does
  not reset ``expiries_in_row``); so does a result refused as stale (``learner/service.py``).
- **Priority**: one lease of room in the in-flight budget is kept for each live proven peer that
  returns work faster than the one asking (than any unproven one), is not backed off and holds
  no lease (it just answered and is about to ask): a freed slot goes to the fastest, not to
  whoever polls most. Once an unproven peer holds a lease, other unproven askers see every
  proven peer's remaining leases kept (up to ``max_leases_per_peer``): a crowd of fresh
  identities fills only what the proven nodes leave, yet one newcomer at a time can prove itself:
  while no unproven peer holds a lease, an unproven asker sees no room kept and a proven asker
  sees one more lease kept for the newcomer that asked last, so proven nodes that fill the whole
  budget cannot keep a late joiner out for ever (the namespace lab's public node, joined after two
  NAT'd nodes had proven themselves, got no lease in 60 steps at S = 2). A crowd gains nothing by
  it: it holds one lease at a time, as before.
- **Size**: a peer slower than the reference is leased what it can finish in ``SIZE_SLACK`` × the
  reference's time for the full lease (at least one prompt): a peer within that factor of the
  fleet's pace gets full leases, a much slower one (a slow-walker) small ones.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

from echorl.learner.peers import PeerBook, PeerLoad

PROVEN_LEASES = 3
"""Leases in a row answered in time that make a peer proven (it ranks in the reference and is
kept room for): an honest node is proven within its first few leases."""
DEADLINE_FACTOR = 4.0
"""A lease's deadline is this many times the fleet's expected time (the factor the learner always
used over a node's own expected time)."""
LATE_FACTOR = 2.0
"""A result later than this many times the fleet's expected time counts against the peer: an
honest node of the fleet's pace has 2x headroom; a slow-walker is late on every lease but one."""
SIZE_SLACK = 1.5
"""A peer is leased what it finishes in this many times the fleet's time for a full lease: under
``LATE_FACTOR``, so a sized lease is on time, and over 1, so a peer a little slower than the fastest
on its address (every demo node shares 127.0.0.1) is not cut to one prompt per lease, which doubled
the demo's submissions and round trips."""
STEP_WEIGHT = 0.3
"""Weight of the newest step period in the learner's moving step period (the horizon's unit)."""
MAX_DEADLINE_BASES = 20.0
"""The longest deadline, in base timeouts (``lease_timeout_s``)."""
REFERENCE_TTL_S = 1.0
"""How long the fleet's ranking (``Ranking``: the reference rate and the live proven peers by rate)
is reused when no result or expiry landed since: members coming and going move it by one
member's vote, a second late."""
RANK_S_PER_MEMBER = 2e-4
"""After a result or an expiry (``FleetPace.changed``) the ranking is recomputed once it is this
many seconds old per live member: a recompute scans every member (~1 µs each), and at 1,000 peers
recomputing after every result, with two more such scans per lease request (the proven count, the
room kept), was 15 % of the learner's loop (py-spy). So the scans stay under ~0.5 % of a core at
any N: a change is seen 0.2 s late at 1,000 members; under ``RANK_AT_ONCE_UNDER`` members at once."""
RANK_AT_ONCE_UNDER = 100
"""Below this many live members every change is ranked at once (a scan of under 100 members is
under 0.1 ms): small swarms, the demo's and the tests', see each result in the next lease."""


def rescan_after_s(scanned: int) -> float:
    """How old a figure that scans ``scanned`` records (members, leases) may be before a change
    is counted again: ``RANK_S_PER_MEMBER`` a record, at once under ``RANK_AT_ONCE_UNDER``."""
    return 0.0 if scanned < RANK_AT_ONCE_UNDER else RANK_S_PER_MEMBER * scanned


@dataclass(frozen=True)
class Ranking:
    """The live members' pace at one moment (``FleetPace.ranking``)."""

    rate: float  # the reference rate (0: no one measured)
    proven: list[tuple[float, str]]  # the live proven peers' (recent rate, peer id), fastest first
    at: float  # when computed (monotonic)
    members: int  # live members scanned


def is_proven(load: PeerLoad | None) -> bool:
    """The one test of *proven*: the peer's last ``PROVEN_LEASES`` leases were answered in time."""
    return load is not None and load.on_time_in_row >= PROVEN_LEASES


class FleetPace:
    """The reference rate of the peer book's live members and the learner's step period."""

    def __init__(self, book: PeerBook) -> None:
        self.book = book
        self.step_s = 0.0  # moving step period of the learner (0: fewer than two versions seen)
        self._version = -1
        self._version_at = 0.0
        self._ranking: Ranking | None = None  # the last ranking (REFERENCE_TTL_S, RANK_S_PER_MEMBER)
        self._changed = False  # a result or an expiry landed since the last ranking

    def note_version(self, version: int, now: float) -> None:
        """The trainer's version now: each advance updates the step period."""
        if version > self._version >= 0:
            per = (now - self._version_at) / (version - self._version)
            self.step_s = per if self.step_s <= 0 else STEP_WEIGHT * per + (1 - STEP_WEIGHT) * self.step_s
        if version != self._version:
            self._version, self._version_at = version, now

    def horizon_s(self, steps_left: int | None) -> float:
        """Seconds until a lease with ``steps_left`` steps before its version goes stale would be
        stale at the learner's recent pace (inf: not known)."""
        if steps_left is None or self.step_s <= 0:
            return math.inf
        return max(1, steps_left) * self.step_s

    def changed(self) -> None:
        """A peer's load changed (a result, an expiry): the next ranking is computed afresh once
        the last is ``RANK_S_PER_MEMBER`` × members old."""
        self._changed = True

    def ranking(self, now: float | None = None) -> Ranking:
        """The live members' reference rate and proven peers by rate, at most ``REFERENCE_TTL_S``
        old, or ``RANK_S_PER_MEMBER`` × members old after a change (at once under
        ``RANK_AT_ONCE_UNDER`` members; a ``now`` before the last ranking, a test's clock, computes
        afresh)."""
        now = time.monotonic() if now is None else now
        r = self._ranking
        age = math.inf if r is None else now - r.at
        if r is None or not 0 <= age < REFERENCE_TTL_S or (self._changed and age >= rescan_after_s(r.members)):
            r = self._ranking = self._rank(now)
            self._changed = False
        return r

    def reference_rate(self) -> float:
        """Median over addresses of each address's best recent rate (0: no one measured)."""
        return self.ranking().rate

    def _rank(self, now: float) -> Ranking:
        best: dict[str, float] = {}
        proven_best: dict[str, float] = {}
        proven: list[tuple[float, str]] = []
        members = self.book.active(now=now)
        for p in members:
            load, key = self._load(p.peer_id), p.ip_key or p.peer_id
            rate, sure = load.recent_per_s, is_proven(load)
            if sure:
                proven.append((rate, p.peer_id))
            if rate > 0:
                best[key] = max(best.get(key, 0.0), rate)
                if sure:
                    proven_best[key] = max(proven_best.get(key, 0.0), rate)
        rates = proven_best or best
        proven.sort(reverse=True)
        return Ranking(statistics.median(rates.values()) if rates else 0.0, proven, now, len(members))

    def expected_s(self, n_prompts: int) -> float:
        """What the fleet takes for a lease of ``n_prompts`` (0: not measured yet)."""
        ref = self.reference_rate()
        return n_prompts / ref if ref > 0 else 0.0

    def sized(self, peer_id: str, n_prompts: int) -> int:
        """Prompts the peer finishes in ``SIZE_SLACK`` × the time the reference takes for
        ``n_prompts`` (≥ 1)."""
        own, ref = self._load(peer_id).recent_per_s, self.reference_rate()
        if own <= 0 or ref <= 0 or own >= ref:
            return n_prompts
        return max(1, min(n_prompts, int(SIZE_SLACK * n_prompts * own / ref)))

    def reserved(
        self,
        peer_id: str,
        prompts_per_lease: int,
        now: float,
        held: Mapping[str, int],
        max_leases: int = 1,
        newcomer_asking: bool = False,
    ) -> int:
        """Prompts of room kept for the live proven peers that return work faster than
        ``peer_id`` and are not backed off (``held``: open leases by holder): one lease each for
        those that hold none (they just answered and are about to ask; one that holds one is at
        work). For an unproven asker while another unproven peer already holds a lease, every
        proven peer's remaining wants are kept (``max_leases`` each, less what it holds): unproven
        identities may then fill only what proven nodes leave, so a crowd of them cannot take the
        second lease of every honest node; with no unproven lease out, one lease of room stays
        open to them, so a newcomer can still prove itself, and is kept from a proven asker while
        ``newcomer_asking`` (an unproven peer asked for work recently; see the module docstring)."""
        own = self._load(peer_id)
        proven = is_proven(own)
        mine = own.recent_per_s if proven else 0.0  # unproven: ranks last
        unproven_out = any(self._unproven(holder) for holder, n in held.items() if n > 0)
        if not proven and not unproven_out:
            return 0  # a lone newcomer: its one lease goes ahead of the proven peers
        crowd = not proven
        leases = int(newcomer_asking and not unproven_out)
        for rate, pid in self.ranking(now).proven:  # fastest first
            if rate <= mine:
                break
            load = self.book.loads.get(pid)
            if pid == peer_id or load is None or load.backoff_until > now:
                continue
            have = held.get(pid, 0)
            leases += max(0, max_leases - have) if crowd else int(have == 0)
        return leases * prompts_per_lease

    def _unproven(self, peer_id: str) -> bool:
        return not is_proven(self._load(peer_id))

    def _load(self, peer_id: str) -> PeerLoad:
        return self.book.loads.get(peer_id) or PeerLoad()


class SlotClock:
    """A shared clock of retry slots: each deferred asker is told to come back at the next free
    slot, ``slot_s`` after the one before, so a crowd deferred at once returns spread out, not
    together (``Newcomers.retry_s``, ``GrantPace.wait_s``)."""

    def __init__(self) -> None:
        self._next = 0.0  # the next free slot

    def take(self, now: float, slot_s: float, earliest_s: float, most_s: float) -> float:
        """Seconds from ``now`` to the slot taken: the next free one, at least ``earliest_s`` and
        at most ``most_s`` away."""
        at = min(max(self._next, now + earliest_s), now + most_s)
        self._next = at + slot_s
        return at - now
