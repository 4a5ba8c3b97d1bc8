"""A version's announcement sent down the plan (protocol.md §4.5; issue 27).

The announcement names every member (1.25 MB at 10,000 members), so a learner that sends each
member its own copy uploads N² bytes a version: 12.5 GB at 10,000 members, ~1,000 s on a
100 Mbit/s uplink (``bench/flowsim.py``'s ``announce_upload_s``), before the first chunk. Instead:

- ``forward_flags`` picks the members whose stripe-0 parent can pass the announcement on: both
  took the last announcement (so the member holds a plan naming the parent, and admits it), the
  parent is not the learner, and the parent can reach the member: it is reachable, or behind NAT
  under the same stripe-0 parent as last time (it dialled that parent for the last version's
  chunks; that connection is the way in). The learner signs these flags (``PlanMember.forward``)
  into the announcement and sends it itself to every other member.
- A member forwards the learner's signed bytes to its flagged stripe-0 children (``Relay``); a
  child that took it from a parent tells the learner (``AnnounceHeard``).
- ``AnnounceRound`` sends the learner's own copy to every flagged member not heard from by its
  depth in stripe 0 times ``hop_s``: a parent that forwards nothing, or late, costs the members
  below it one deadline, never the version; and ``Forwarders`` then leaves that parent out as a
  forwarder for ``NO_FORWARD_FOR`` × 2^(k−1) publications at its k-th offence (at most
  ``MAX_NO_FORWARD``), so a withholder costs its children that deadline a handful of times a run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence, Set

import trio

from echorl.net.host import Host, PeerUnavailable
from echorl.protocol.errors import ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import BroadcastAck, PlanMember
from echorl.protocol.plan import BroadcastPlan
from echorl.protocol.routes import ANNOUNCE

log = logging.getLogger(__name__)

#: Publications a member that did not pass an announcement on is not relied on for, at its first
#: offence: short, since one whose child was unreachable once (a closed NAT connection) is honest;
#: doubled at each further one (to ``MAX_NO_FORWARD``), since a toy swarm publishes several
#: versions a second and a fixed 16 would let a withholder cost its children a wait every few seconds.
NO_FORWARD_FOR = 16
MAX_NO_FORWARD = 4096
MAX_OFFENDERS = 2 * 16384  # offence records kept (two plans' worth of members)


def forward_flags(
    plan: BroadcastPlan,
    members: Sequence[PlanMember],
    took_last: Set[str],
    last_parent: Mapping[str, str],
    not_forwarders: Set[str] = frozenset(),
) -> set[str]:
    """The members the learner leaves to their stripe-0 parent (see the module docstring).
    ``took_last``: who took the last announcement; ``last_parent``: stripe-0 parents in its plan;
    ``not_forwarders``: parents not relied on (they withheld a recent one)."""
    parent = plan.stripes[0].parent_of() if plan.stripes else {}
    out: set[str] = set()
    for m in members:
        p = parent.get(m.peer_id)
        if p is None or p == plan.learner or p in not_forwarders or not {m.peer_id, p} <= took_last:
            continue
        if m.reachable or last_parent.get(m.peer_id) == p:
            out.add(m.peer_id)
    return out


class Forwarders:
    """The learner's memory of announcements past: who took the last one and under which stripe-0
    parent, and which members withheld one (out as forwarders for ``NO_FORWARD_FOR`` × 2^(k−1)
    publications at their k-th offence)."""

    def __init__(self) -> None:
        self.took_last: set[str] = set()
        self.last_parent: dict[str, str] = {}
        self.benched: dict[str, int] = {}  # member -> the last publication it is not relied on in
        self.offences: dict[str, int] = {}  # member -> announcements it withheld (bounded: see note)
        # all publications: the learner's own copies, members that heard it from a parent, and
        # members left to a parent that got the learner's copy at their deadline
        self.counters = {"announce_sends": 0, "announce_heard": 0, "announce_late": 0}

    def flags(self, plan: BroadcastPlan, members: Sequence[PlanMember], publication: int) -> set[str]:
        """``forward_flags`` for publication number ``publication``."""
        benched = {p for p, until in self.benched.items() if until >= publication}
        return forward_flags(plan, members, self.took_last, self.last_parent, benched)

    def note(self, plan: BroadcastPlan, took: Set[str], done: AnnounceRound, publication: int) -> None:
        """After publication ``publication``: remember who took it, and bench each parent that
        took it but left a flagged child to the learner's copy (forwarded nothing, or late)."""
        parent = plan.stripes[0].parent_of() if plan.stripes else {}
        for key, n in (("announce_sends", done.sent), ("announce_heard", done.heard_count)):
            self.counters[key] += n
        self.counters["announce_late"] += len(done.fell_back)
        for child in done.fell_back:
            p = parent.get(child)
            if p is not None and p in took and p not in self.benched:
                k = self.offences[p] = self.offences.get(p, 0) + 1
                self.benched[p] = publication + min(MAX_NO_FORWARD, NO_FORWARD_FOR << (k - 1))
        self.benched = {p: u for p, u in self.benched.items() if u > publication}
        if len(self.offences) > MAX_OFFENDERS:  # members long gone: forget the oldest records
            self.offences = dict(list(self.offences.items())[-MAX_OFFENDERS // 2 :])
        self.took_last, self.last_parent = set(took), parent


class AnnounceRound:
    """One version's announcement at the learner: the requests it sends and who took it.

    ``took``: members that answered the learner's request or said a parent forwarded it to them;
    ``asked``: members not yet settled either way (a request in flight, or a forward expected),
    waited for like the rest; a failed request settles a member as a miss. ``run`` sends the
    learner's copies: at once to members not in ``forwarded``, then depth by depth to forwarded
    ones not heard from by ``depth[peer] × hop_s``. Cancel it to stop: still unanswered is a miss.
    """

    def __init__(
        self,
        host: Host,
        encoded: bytes,
        members: Sequence[PlanMember],
        forwarded: Set[str],
        depth: Mapping[str, int],
        *,
        timeout_s: float,
        hop_s: float,
        on_change: Callable[[], None],
    ) -> None:
        self.host, self.encoded = host, encoded
        self.direct = [m.peer_id for m in members if m.peer_id not in forwarded]
        self.levels: dict[int, list[str]] = {}
        for m in members:
            if m.peer_id in forwarded:
                self.levels.setdefault(max(1, depth.get(m.peer_id, 1)), []).append(m.peer_id)
        self.timeout_s, self.hop_s, self.on_change = timeout_s, hop_s, on_change
        self.took: set[str] = set()
        self.asked: set[str] = {m.peer_id for m in members}
        self.sent = 0  # the learner's own requests (the first wave and the fallbacks)
        self.fell_back: set[str] = set()  # flagged members that got the learner's copy instead
        self.heard_count = 0  # members that took it from a parent

    async def run(self) -> None:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for peer in self.direct:
                nursery.start_soon(self._send, peer)
            for d in sorted(self.levels):
                await trio.sleep_until(start + d * self.hop_s)
                for peer in self.levels[d]:
                    if peer in self.asked:
                        log.info("announce to %s not forwarded in %.1f s: sent", short_id(peer), d * self.hop_s)
                        self.fell_back.add(peer)
                        nursery.start_soon(self._send, peer)

    async def _send(self, peer: str) -> None:
        self.sent += 1
        try:
            await self.host.request(peer, ANNOUNCE, self.encoded, expect=BroadcastAck, timeout=self.timeout_s)
            self.took.add(peer)
        except (PeerUnavailable, ProtocolError) as exc:
            log.info("announce to %s failed: %s", short_id(peer), exc)
        finally:
            self.asked.discard(peer)
            self.on_change()

    def heard(self, peer: str) -> None:
        """``peer`` says a plan parent forwarded it the announcement (``AnnounceHeard``)."""
        if peer in self.asked:
            self.asked.discard(peer)
            self.took.add(peer)
            self.heard_count += 1
            self.on_change()
