"""The learner's background duties, every ``interval_s``: overdue leases expire, members that never
worked are dropped, refused joiners' connections closed, quiet members pinged (one that does not
answer is lost: its leases expire at once and it leaves broadcast plans), and with cost-aware
activation the active set is re-decided.

``Upkeep`` owns the ``Liveness`` sweep and its ``LoopLag`` (a ping that timed out while this loop
ran late is excused, ``learner/liveness.py``); every other fact it changes belongs to the component
it calls (``LeaseBook``, ``Admission``, ``Roster``, ``Activator``, ``PeerBook``, the buffer).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from echorl.learner.activation import Activator
from echorl.learner.admission import Admission
from echorl.learner.config import ServiceFields
from echorl.learner.leases import LeaseBook, LeaseRecord
from echorl.learner.liveness import Liveness
from echorl.learner.peers import PeerBook
from echorl.learner.roster import Roster
from echorl.net.host import Host
from echorl.protocol.identity import short_id
from echorl.rl.buffer import StalenessBuffer

log = logging.getLogger(__name__)


class Upkeep:
    """The maintenance loop of :class:`echorl.learner.service.LearnerService` (``run``)."""

    def __init__(
        self,
        peers: PeerBook,
        leases: LeaseBook,
        admission: Admission,
        roster: Roster,
        activator: Activator,
        buffer: StalenessBuffer,
        settings: ServiceFields,
        version: Callable[[], int],
    ) -> None:
        self.peers, self.leases, self.admission = peers, leases, admission
        self.roster, self.activator, self.buffer = roster, activator, buffer
        self._version = version
        self.liveness = Liveness(peers, settings, self.lost)

    def requeue(self, gone: list[LeaseRecord]) -> None:
        """The prompts of leases that ended without a result go back to the queue."""
        for rec in gone:
            self.buffer.requeue(rec.prompts)

    async def run(self, host: Host | None, interval_s: float = 0.5) -> None:
        """Forever (``host`` None: no pings, as in tests without a network)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.liveness.lag.run)
            while True:
                await self.tick(host, time.monotonic())
                await trio.sleep(interval_s)

    async def tick(self, host: Host | None, now: float) -> None:
        self.admission.pace.note_version(self._version(), now)
        if self.activator.due(now):
            self.activator.reactivate()
        expired = self.leases.expire_due(now)
        self.requeue(expired)
        for rec in expired:
            log.debug("lease %s of %s expired", rec.lease_id, short_id(rec.peer_id))
            self.admission.on_expired(rec.peer_id)
        self._drop_idle()
        if host is not None:
            await self._close_refused(host)
            await self.liveness.sweep(host, now)

    def _drop_idle(self) -> None:
        """Forget members that never worked and joined long ago or stopped answering."""
        busy = {r.peer_id for r in self.leases.active.values()}
        busy |= {p for p in self.peers if self.activator.is_standby(p)}
        self.roster.drop_idle(busy)

    async def _close_refused(self, host: Host) -> None:
        """Close the connections of joiners the roster refused (after their answer went out)."""
        refused = self.roster.take_refused()
        if refused:
            async with trio.open_nursery() as nursery:
                for pid in refused:
                    if pid not in self.peers:
                        nursery.start_soon(host.disconnect, pid)

    def lost(self, peer_id: str, why: str) -> None:
        """A member that did not answer its ping: its leases expire at once, it leaves plans."""
        gone = self.leases.expire_peer(peer_id)
        self.requeue(gone)
        if self.peers.mark_dead(peer_id):
            log.warning("peer %s unresponsive (%s): %d leases expired", short_id(peer_id), why, len(gone))
            self.activator.lost(peer_id)
