"""Which members still answer: the learner pings every live member not heard from lately, and one
that does not answer is lost (its leases expire at once, it leaves broadcast plans) — unless the
learner's own loop was too late to read the answer (``LoopLag``).

At 1,000 peers on 2 shared cores (issue 27) the learner's loop ran seconds late: liveness pings
timed out on the learner's side, it marked the peers dead and expired their leases, and the
re-queued work came back as more load — a collapse, not a slowdown. ``LoopLag`` keeps a task
sleeping ``TICK_S`` at a time and records how much later than that it woke; the service asks
``worst_since(t)`` when a ping started at ``t`` timed out, and a timeout during which the loop
was ``EXCUSE_FRACTION`` of the ping's timeout late is the learner's, not the peer's: the peer stays
alive and is pinged again (``pings_excused``).

The sweep's own cost is bounded too: a ping is a stream open, a protocol negotiation, an echo and
a close on the learner's loop, and pinging every member quiet for ``liveness_after_s`` (3 s) costs
a rate that grows with N — at 1,000 peers whose leases take 10 s, each is quiet twice a lease,
hundreds of pings a second. A member is pinged once it has been quiet for ``liveness_after_s`` or
for N / ``MAX_PINGS_PER_S``, whichever is longer, so the learner sends at most
``MAX_PINGS_PER_S`` pings a second at any N; a member that works is heard at each lease and
submission and is not pinged at all. A dead node in a large swarm is noticed later (50 s at 1,000
members), and its leases still expire at their deadline.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from echorl.learner.peers import PeerBook
from echorl.protocol.identity import short_id

if TYPE_CHECKING:
    from echorl.learner.config import ServiceFields
    from echorl.net.host import Host

log = logging.getLogger(__name__)

TICK_S = 0.1
"""The sampler's sleep: the loop's lateness is measured at this resolution, at ~10 wake-ups a
second (nothing next to a learner's request load)."""
KEEP_S = 60.0
"""How long lateness samples are kept: longer than any ping timeout worth excusing."""
PING_ROUNDS = 8
"""About how many of the loop's scheduling rounds a libp2p ping takes on the learner's side (stream
open, protocol negotiation, the echo, close), each as late as the loop runs."""
EXCUSE_FRACTION = 1 / (2 * PING_ROUNDS)
"""A ping timeout is the learner's when its loop ran this fraction of the timeout late while the
ping was out (0.19 s of a 3 s timeout): at that lateness in each of its rounds the ping spends half
its timeout waiting for the learner alone. A loaded but healthy loop is late by milliseconds; at
1,000 peers on 2 cores a first cut at a quarter of the timeout excused too few, and the learner
still marked 2,649 live members dead in one run."""
MAX_PINGS_PER_S = 20.0
"""The most liveness pings the learner sends a second, whatever the number of members (the quiet
time before a ping grows as N / this): a ping is ~0.7 ms of the learner's loop (py-spy, 300 peers),
so 20 a second is ~1.5 % of a core; at 3 s for every member, 1,000 members cost hundreds a second."""


class LoopLag:
    """Samples of how late the trio loop woke a sleeping task: ``run`` in a nursery, read with
    ``worst_since``."""

    def __init__(self) -> None:
        self._late: deque[tuple[float, float]] = deque()  # (when woken, seconds late), oldest first
        self._tick_from = -1.0  # when the sleep in progress began (-1: none)

    async def run(self) -> None:
        """Forever: sleep ``TICK_S``, note how late the wake-up came."""
        while True:
            self._tick_from = trio.current_time()
            await trio.sleep(TICK_S)
            now = trio.current_time()
            self.note(now, now - self._tick_from - TICK_S)

    def note(self, now: float, late_s: float) -> None:
        self._late.append((now, max(0.0, late_s)))
        while self._late and now - self._late[0][0] > KEEP_S:
            self._late.popleft()

    def worst_since(self, since: float, now: float | None = None) -> float:
        """The most the loop was late since ``since`` (trio clock), counting the sleep in progress
        if it is overdue (the sampler may not have run yet after a stall)."""
        now = trio.current_time() if now is None else now
        worst = max((late for at, late in self._late if at >= since), default=0.0)
        if self._tick_from >= 0:
            worst = max(worst, now - self._tick_from - TICK_S)
        return worst

    def metrics(self) -> dict[str, float]:
        """``loop_lag_p50_ms``, ``loop_lag_p99_ms``, ``loop_lag_max_ms`` over the samples kept
        (``KEEP_S``; none before the first): how long a request that arrived waited for the loop,
        the learner's own part of any peer's latency (the status and the metrics row)."""
        if not self._late:
            return {}
        s = sorted(late for _, late in self._late)
        ms = {q: round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 2) for q in (0.5, 0.99)}
        return {"loop_lag_p50_ms": ms[0.5], "loop_lag_p99_ms": ms[0.99], "loop_lag_max_ms": round(s[-1] * 1e3, 2)}

    def excuses(self, since: float, timeout_s: float, now: float | None = None) -> bool:
        """Whether a wait of ``timeout_s`` begun at ``since`` that ran out is the loop's fault."""
        return self.worst_since(since, now) >= EXCUSE_FRACTION * timeout_s


class Liveness:
    """Pings the quiet live members of ``book`` (``liveness_after_s`` without a word, each ping
    ``ping_timeout_s``); ``lost(peer_id, why)`` is called for one that did not answer."""

    def __init__(self, book: PeerBook, settings: ServiceFields, lost: Callable[[str, str], None]) -> None:
        self.book, self.settings, self.lost = book, settings, lost
        self.lag = LoopLag()
        self.counters = {"pings": 0, "pings_excused": 0}  # sent; timed out while the loop ran late

    def quiet_after_s(self, members: int) -> float:
        """How long a live member may go unheard before it is pinged: ``liveness_after_s``, or
        longer with many members, so that pings stay under ``MAX_PINGS_PER_S``."""
        return max(self.settings.liveness_after_s, members / MAX_PINGS_PER_S)

    async def sweep(self, host: Host, now: float) -> None:
        """Ping every quiet live member at once; returns when each answered, failed or timed out."""
        live = [p for p in self.book.values() if p.alive]
        after = self.quiet_after_s(len(live))
        quiet = [p.peer_id for p in live if now - p.last_seen > after]
        self.counters["pings"] += len(quiet)
        async with trio.open_nursery() as nursery:
            for pid in quiet:
                nursery.start_soon(self._probe, host, pid)

    async def _probe(self, host: Host, peer_id: str) -> None:
        from echorl.net.host import PeerUnavailable

        timeout_s, since = self.settings.ping_timeout_s, trio.current_time()
        try:
            await host.ping(peer_id, timeout=timeout_s)
            self.book.heard(peer_id)
        except PeerUnavailable as exc:
            if self.lag.excuses(since, timeout_s):  # the learner was late, not the peer
                self.counters["pings_excused"] += 1
                log.debug("ping of %s timed out while the loop ran late: excused", short_id(peer_id))
                return
            self.lost(peer_id, str(exc))
