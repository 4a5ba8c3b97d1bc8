"""The unproven peers' share of the in-flight budget (docs/threat-model.md, "slow-walking lease
hoarder"): how many leases peers that have not yet proven themselves may hold together, how that is
split by address, whose turn a freed slot is, and when a deferred newcomer asks again.

A peer is proven once its last ``PROVEN_LEASES`` leases were answered in time (``learner/pace.py``).
Until then it holds one lease, and all unproven peers together hold at most the **newcomer budget**:

- half of the in-flight budget while no live peer is proven (someone must start);
- then one lease per ``PROVEN_PER_NEWCOMER_LEASE`` live proven peers, plus one lease for each
  lease a newcomer answered in time *after its first* within ``EARNED_TTL_S`` (``earned``), less
  ``LATE_COST`` for each lease anyone answered late or let expire; never more than the half.

The earned part is what lets a thousand honest newcomers in (issue 27): with a lease per four proven
peers alone, the proven count grew by a quarter of itself every three lease times, and at 1,000
peers whose leases take 10 s most were still waiting for their first lease minutes after they
joined. A newcomer's second and third answers in time each earn one more lease for newcomers, so the
budget doubles about every lease and a half while they answer. A slow-walker earns nothing: its
opening answer is fast but earns no lease (one fast answer proves nothing), its second is late and
takes ``LATE_COST`` leases back; a proven peer that walks one lease in four, re-proving itself in
between, earns two and loses two. Identities can spend what honest newcomers earned, for at most
``EARNED_TTL_S``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection

from echorl.learner.leases import LeaseRecord
from echorl.learner.pace import FleetPace, SlotClock, is_proven, rescan_after_s
from echorl.learner.peers import PeerBook

ASKING_WINDOW_S = 10.0
"""An address counts in the split of the unproven budget while one of its unproven peers asked for
work this recently: many retries of a deferred peer (``retry_after_s`` ≤ 0.5 s) apart, so a
newcomer waiting for room keeps its address's share, and an identity that stopped asking (idle,
backed off) soon gives its share back."""
TURN_WINDOW_S = 2.0
"""An address waits for its turn at the unproven budget while one of its unproven peers asked
this recently (four retries of a deferred newcomer): when the budget has room for fewer than
every waiting address, the address whose last unproven lease is oldest goes first."""
UNPROVEN_RETRY_S = 0.5
"""``retry_after_s`` of a ``paced`` deferral to an unproven peer: room for one comes only when a
lease settles, so asking 20 times a second buys it nothing, and a crowd of identities polling
costs the learner's loop (issue 24: 32 slow-walkers asked ~250 times a second)."""
UNPROVEN_SLOT_S = 0.05
"""Unproven peers together are told to ask again at most this often: each deferral to one takes
the next free slot of one clock shared by all of them, so a crowd of identities (32 walkers on
8 addresses, each asking every 0.5 s, cost the learner and the machine ~110 answers a second)
asks no more than 20 times a second in all, while a lone newcomer still asks every 0.5 s."""
UNPROVEN_RETRY_MAX_S = 5.0
"""The longest ``retry_after_s`` the shared clock gives an unproven peer: a newcomer among a
crowd of any size asks again within this, and a freed slot waits for its address's turn
(``TURN_WINDOW_S``), not for its poll."""
PROVEN_PER_NEWCOMER_LEASE = 4
"""While proven peers work, unproven peers together hold at least one lease for every this many
live proven peers (at least one; half the in-flight budget before anyone is proven): a newcomer
needs one lease at a time to prove itself, while a crowd of identities on many addresses that
hold each lease to its deadline took up to half the budget (issue 24, ``slow_walker_8x4``: 0.64 of
clean goodput with half, 0.83 with one lease)."""
EARNED_TTL_S = 60.0
"""How long a lease earned by a newcomer's answer in time counts in the budget: several lease
times of an honest fleet (the budget keeps what the answering newcomers hold), and what a crowd
arriving after the newcomers proved themselves can spend at most."""
LATE_COST = 2
"""Earned leases taken back for each lease answered late or let expire, by anyone: more than an
answer earns, so identities that take leases and walk them lose the budget faster than any of them
could earn it, and a proven peer that walks a lease now and then and proves itself again in
between (its second and third answers earn) gains nothing for its accomplices."""


class Newcomers:
    """The newcomer budget and its turns; each deferral and grant to an unproven peer goes through
    here. Reads the peer book and the fleet's ranking; owns only its own fields."""

    def __init__(self, book: PeerBook, pace: FleetPace) -> None:
        self.book, self.pace = book, pace
        # address -> when an unproven peer from it last asked for work, oldest ask first
        self.asking: dict[str, float] = {}
        self.last_ask = ("", -math.inf)  # the unproven peer that last asked for work, and when
        self.granted: dict[str, float] = {}  # address -> when an unproven peer from it was last leased
        self._held: dict[str, int] = {}  # address -> prompts its unproven peers hold, as last counted
        self._held_at = -math.inf  # when ``_held`` was counted (``rescan_after_s`` of the open leases)
        self.earned: deque[float] = deque()  # when each earned lease was earned, oldest first
        self._retries = SlotClock()  # the unproven peers' shared retry clock
        self.counters = {"newcomer_leases_earned": 0, "newcomer_leases_lost": 0}

    def answered(self, in_row_before: int, now: float) -> None:
        """An unproven peer answered a lease in time, after ``in_row_before`` in a row: its
        second and later answers each earn newcomers a lease (its first, a slow-walker's opening,
        none)."""
        if in_row_before >= 1:
            self.earned.append(now)
            self.counters["newcomer_leases_earned"] += 1

    def walked(self) -> None:
        """A peer answered a lease late or let it expire: ``LATE_COST`` earned leases go."""
        for _ in range(min(LATE_COST, len(self.earned))):
            self.earned.pop()  # the newest: the rest would expire sooner anyway
            self.counters["newcomer_leases_lost"] += 1

    def budget(self, in_flight_cap: int, prompts_per_lease: int, now: float) -> int:
        """Prompts all unproven peers may hold together (see the module docstring)."""
        half = max(prompts_per_lease, in_flight_cap // 2)
        while self.earned and now - self.earned[0] > EARNED_TTL_S:
            self.earned.popleft()
        proven = len(self.pace.ranking(now).proven)  # live proven peers (pace.py: RANK_S_PER_MEMBER)
        if proven == 0:
            return half
        leases = math.ceil(proven / PROVEN_PER_NEWCOMER_LEASE) + len(self.earned)
        return min(half, prompts_per_lease * leases)

    def room(
        self,
        peer_id: str,
        in_flight_cap: int,
        prompts_per_lease: int,
        active: Collection[LeaseRecord],
        now: float,
    ) -> int:
        """Prompts one more unproven peer, ``peer_id``, may be leased: unproven peers together
        hold at most ``budget``, so identities that take a lease and never answer, or answer it
        slowly, cannot starve the proven, working nodes; and the budget is shared by address
        (IPv4 address, IPv6 /64): the unproven peers of one address hold at most an equal share
        of it among the addresses whose unproven peers asked within ``ASKING_WINDOW_S`` (at
        least one lease), so one address's fresh identities cannot keep every newcomer elsewhere
        waiting, and idle ones shrink no one's share. When the budget has room for fewer leases
        than the addresses waiting for one (asked within ``TURN_WINDOW_S``, holding none), the
        address whose last unproven lease is oldest goes first, so a crowd that asks more often
        does not win every freed slot. ``active``: the lease records. Called for every lease
        request of an unproven peer that is otherwise ready for work: its cost does not grow with
        the swarm (issue 27; a scan of every open lease here was 7 % of the learner at 1,000 peers)."""
        budget, mine = self.budget(in_flight_cap, prompts_per_lease, now), self.book.address_of(peer_id)
        self._asked(mine, now)
        self.last_ask = (peer_id, now)
        held = self._unproven_held(active, now)
        free, turn = budget - sum(held.values()), self.granted.get(mine, -math.inf)
        ahead = 0
        for a, t in reversed(self.asking.items()):  # the newest asks first: stop at the turn window
            if now - t >= TURN_WINDOW_S:
                break
            ahead += a not in held and self.granted.get(a, -math.inf) < turn
        if ahead and free < prompts_per_lease * (ahead + 1):
            return 0  # not this address's turn
        share = max(prompts_per_lease, budget // len(self.asking))
        return min(free, share - held.get(mine, 0))

    def _asked(self, address: str, now: float) -> None:
        """``address`` asked now; addresses that last asked ``ASKING_WINDOW_S`` ago leave the split
        (and their turns with them), oldest first, so a request costs what expired, not the crowd."""
        self.asking.pop(address, None)
        self.asking[address] = now
        while True:  # oldest first; stops at the first still asking (this one, at the latest)
            a, t = next(iter(self.asking.items()))
            if now - t < ASKING_WINDOW_S:
                break
            del self.asking[a]
            self.granted.pop(a, None)

    def _unproven_held(self, active: Collection[LeaseRecord], now: float) -> dict[str, int]:
        """Prompts held by unproven peers, by address: counted afresh once the last count is
        ``rescan_after_s`` of the open leases old (pace.py's rule: at once under 100 leases, 0.2 s
        late at 1,000), with the grants made since added (``grant``). Until the next count a
        settled lease still counts and a peer's change of standing is not seen: the budget errs
        for a fraction of a second, toward fewer newcomer leases except where a proven peer fell."""
        if not 0 <= now - self._held_at < rescan_after_s(len(active)):
            book, held = self.book, dict[str, int]()
            for r in active:
                if not is_proven(book.loads.get(r.peer_id)):
                    a = book.address_of(r.peer_id)
                    held[a] = held.get(a, 0) + len(r.prompts)
            self._held, self._held_at = held, now
        return self._held

    def grant(self, peer_id: str, prompts: int, now: float) -> None:
        """An unproven peer was leased up to ``prompts``: its address's turn was taken now, and the
        prompts count in its address's holdings until the next count."""
        a = self.book.address_of(peer_id)
        self.granted[a] = now
        self._held[a] = self._held.get(a, 0) + prompts

    def asking_now(self, now: float) -> bool:
        """Whether an unproven peer, otherwise ready for work, asked for a lease within
        ``ASKING_WINDOW_S`` (``FleetPace.reserved`` then keeps it one lease of room)."""
        peer_id, at = self.last_ask
        return now - at < ASKING_WINDOW_S and not is_proven(self.book.loads.get(peer_id))

    def retry_s(self, now: float) -> float:
        """``retry_after_s`` for a deferred unproven peer: ``UNPROVEN_RETRY_S``, or later when the
        shared clock's next free slot is later (``UNPROVEN_SLOT_S``; at most ``UNPROVEN_RETRY_MAX_S``)."""
        slot = self._retries.take(now, UNPROVEN_SLOT_S, UNPROVEN_SLOT_S, UNPROVEN_RETRY_MAX_S)
        return max(UNPROVEN_RETRY_S, slot)
