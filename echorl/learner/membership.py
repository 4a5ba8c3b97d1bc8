"""Who a joined node is, and how its run ends: the learner-side rules a volunteer meets first.

* One key, one live node. A node process sends a random ``instance`` with its join; while the
  peer id's current instance is live (heard from within ``window_s``), a join from another
  instance is refused with ``identity_in_use``: two processes sharing a key would be counted as
  one node (one lease book, one throughput) and steal each other's connection. A restarted node
  (its old process gone quiet) is accepted and replaces the old record.
* A doctor is not a node. ``echorl doctor`` joins with ``Capability.engine == PROBE_ENGINE`` to
  measure a download: it may read weights for ``PROBE_TTL_S`` but gets no peer record, so it never
  appears in the ledger, the summary, the metrics or the liveness sweep (at most ``MAX_PROBES``
  at once).
* The end of a run. Once training is over the learner answers every lease request with a signed
  ``RunEnded`` carrying that node's contribution, and keeps serving for a short grace period
  until every live node has been told, so volunteers exit 0 instead of retrying forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from echorl.learner.roster import member_addrs
from echorl.net.dialback import dial_back
from echorl.protocol import wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity, short_id
from echorl.protocol.messages import (
    PROBE_ENGINE,
    Capability,
    DialBackRequest,
    DialBackResult,
    JoinRequest,
    Message,
    RunEnded,
)

if TYPE_CHECKING:
    from echorl.learner.config import LeaseFields
    from echorl.learner.peers import PeerBook, PeerRecord
    from echorl.net.host import Host, RequestContext

Handler = Callable[[Message, "RequestContext"], Awaitable[Message]]

log = logging.getLogger(__name__)

MAX_PROBES = 16  # doctors probing at once: each may read weights, so their number is bounded
PROBE_TTL_S = 120.0  # how long a doctor's join lets it read weights (its download check takes seconds)


def check_identity(peers: PeerBook, msg: JoinRequest, peer_id: str, window_s: float) -> None:
    """Refuse (``identity_in_use``) a join from a second live process of an already-joined peer
    (its record names its current process's ``instance``)."""
    old = peers.get(peer_id)
    if (
        old is not None
        and msg.instance
        and old.instance
        and msg.instance != old.instance
        and old.alive
        and time.monotonic() - old.last_seen < window_s
    ):
        log.warning("join of %s refused: another live process uses this key", peer_id[:16])
        raise ProtocolError(
            ErrorCode.IDENTITY_IN_USE,
            "another node process with this key is running and joined; give each node its own --key",
        )


class Members:
    """The service's membership rules: who may join (one live process per key), whether a joiner
    is reachable (dial-back), and the end-of-run answer to lease requests."""

    def __init__(self, identity: Identity, run_id: str) -> None:
        self.run_end = RunEnd(identity, run_id)
        self.probes: dict[str, float] = {}  # a doctor's peer id -> when its leave to read weights ends

    def probe(self, msg: JoinRequest, peer_id: str) -> bool:
        """Whether a (verified) join is a doctor's probe; if so it may read weights for
        ``PROBE_TTL_S`` without becoming a node. ``unavailable`` beyond ``MAX_PROBES`` at once."""
        if msg.capability.engine != PROBE_ENGINE:
            return False
        now = time.monotonic()
        self.probes = {p: end for p, end in self.probes.items() if end > now}
        if peer_id not in self.probes and len(self.probes) >= MAX_PROBES:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "too many doctor probes at once; retry in a minute")
        self.probes[peer_id] = now + PROBE_TTL_S
        log.debug("doctor probe from %s (not a node)", short_id(peer_id))
        return True

    def probing(self, peer_id: str) -> bool:
        return self.probes.get(peer_id, 0.0) > time.monotonic()

    async def admit(
        self, msg: JoinRequest, peer_id: str, peers: PeerBook, host: Host | None, policy: LeaseFields
    ) -> Capability:
        """The joiner's capability as the learner will use it (logged as the join): ``identity_in_use``
        for a second live process; ``reachable`` only if a dial-back to its advertised addresses
        works, and its addresses only the one that answered (``net/dialback.py``): what the
        learner dials and what broadcast plans carry is never an unverified, self-declared address
        (a hostile joiner naming a third party's address would aim other nodes at it)."""
        check_identity(peers, msg, peer_id, 2 * (policy.liveness_after_s + policy.ping_timeout_s))
        remote = host.remote_ip(peer_id) if host is not None else None
        claimed = member_addrs(msg.capability.listen_addrs)
        verified = await dial_back(claimed, remote) if msg.capability.reachable else None
        cap = msg.capability.model_copy(
            update={"listen_addrs": [verified] if verified else [], "reachable": verified is not None}
        )
        # A node re-joins on every reconnect (and after a learner restart): only a newcomer is news.
        log.log(
            logging.DEBUG if peers.is_member(peer_id) else logging.INFO,
            "joined: %s (%s, %.0f tok/s, %s)",
            short_id(peer_id),
            cap.device,
            cap.tokens_per_s,
            "reachable" if cap.reachable else "not reachable: a broadcast leaf",
        )
        return cap

    def dial_back_handler(self, host: Host) -> Handler:
        """The ``DIALBACK`` handler: is the caller reachable at the addresses it names?"""

        async def on_dial_back(msg: Message, ctx: RequestContext) -> DialBackResult:
            assert isinstance(msg, DialBackRequest)
            remote = host.remote_ip(ctx.peer_id)
            ok = await dial_back(list(msg.addrs), remote) is not None
            return DialBackResult(reachable=ok, seen_ip=remote or "")

        return on_dial_back

    def lease_or_end(self, handler: Handler, peers: PeerBook) -> Handler:
        """``handler`` for lease requests, answered with ``RunEnded`` once the run is over."""

        async def lease(msg: Message, ctx: RequestContext) -> Message:
            peer = peers.get(ctx.peer_id)
            if self.run_end.final is not None and peer is not None:
                return self.run_end.reply(ctx.peer_id, peer)
            return await handler(msg, ctx)

        return lease


class RunEnd:
    """The end-of-run notice: set once training is over, answered to each lease request."""

    def __init__(self, identity: Identity, run_id: str) -> None:
        self.identity = identity
        self.run_id = run_id
        self.final: tuple[int, int] | None = None  # (version, steps) once the run is over
        self.told: set[str] = set()

    def reply(self, peer_id: str, record: PeerRecord) -> RunEnded:
        assert self.final is not None
        version, steps = self.final
        self.told.add(peer_id)
        return wire.sign(
            RunEnded(
                run_id=self.run_id,
                learner_peer_id=self.identity.peer_id,
                version=version,
                steps=steps,
                leases_done=record.leases_done,
                groups_accepted=record.groups_accepted,
                timestamp=time.time(),
            ),
            self.identity,
        )

    async def announce(self, version: int, steps: int, live: Callable[[], list[str]], grace_s: float) -> None:
        """Mark the run over and wait (at most ``grace_s``) until every live node has asked for
        a lease and been told; ``live()`` lists the live peer ids."""
        self.final = (version, steps)
        with trio.move_on_after(grace_s):
            while set(live()) - self.told:
                await trio.sleep(0.1)
        missing = set(live()) - self.told
        log.info(
            "run over at v%d: %d nodes told%s",
            version,
            len(self.told),
            f", {len(missing)} not reached" if missing else "",
        )
