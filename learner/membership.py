"""Who a joined node is, and how its run ends: the learner-side rules a volunteer meets first.

* One key, one live node. A node process sends a random ``instance`` with its join; while the
  peer id's current instance is live (heard from within ``window_s``), a join from another
  instance is refused with ``identity_in_use``: two processes sharing a key would be counted as
  one node (one lease book, one throughput) and steal each other's connection. A restarted node
  (its old process gone quiet) is accepted and replaces the old record.
* The end of a run. Once training is over the learner answers every lease request with a signed
  ``RunEnded`` carrying that node's contribution, and keeps serving for a short grace period
  until every live node has been told, so volunteers exit 0 instead of retrying forever.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from echorl.protocol import wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import DialBackResult, JoinRequest, RunEnded
from echorl.learner.roster import member_addrs

log = logging.getLogger("echorl.learner.membership")


def check_identity(peers: dict[str, Any], instances: dict[str, bytes], msg: JoinRequest, peer_id: str,
                   window_s: float) -> None:
    """Refuse (``identity_in_use``) a join from a second live process of an already-joined peer;
    otherwise remember ``msg.instance`` as the peer's current process."""
    old = peers.get(peer_id)
    current = instances.get(peer_id, b"")
    if (old is not None and msg.instance and current and msg.instance != current and old.alive
            and time.monotonic() - old.last_seen < window_s):
        log.warning("join of %s refused: another live process uses this key", peer_id[:16])
        raise ProtocolError(ErrorCode.IDENTITY_IN_USE,
                            "another node process with this key is running and joined; give each node its own --key")
    if msg.instance:
        instances[peer_id] = msg.instance


class Members:
    """The service's membership rules: who may join (one live process per key), whether a joiner
    is reachable (dial-back), and the end-of-run answer to lease requests."""

    def __init__(self, identity: Any, run_id: str) -> None:
        self.instances: dict[str, bytes] = {}  # peer id -> its current process's instance
        self.run_end = RunEnd(identity, run_id)

    async def admit(self, msg: JoinRequest, peer_id: str, peers: dict[str, Any], host: Any, policy: Any) -> Any:
        """The joiner's capability as the learner will use it (logged as the join): ``identity_in_use``
        for a second live process; ``reachable`` only if a dial-back to its advertised addresses works."""
        check_identity(peers, self.instances, msg, peer_id, 2 * (policy.liveness_after_s + policy.ping_timeout_s))
        cap = msg.capability.model_copy(update={"listen_addrs": member_addrs(msg.capability.listen_addrs)})
        remote = host.remote_ip(peer_id) if host is not None else None
        if cap.reachable and not await dial_back(list(cap.listen_addrs), remote):
            cap = cap.model_copy(update={"reachable": False})
        log.info("joined: %s (%s, %.0f tok/s, %s)", short_id(peer_id), cap.device, cap.tokens_per_s,
                 "reachable" if cap.reachable else "not reachable: a broadcast leaf")
        return cap

    def dial_back_handler(self, host: Any) -> Any:
        """The ``DIALBACK`` handler: is the caller reachable at the addresses it names?"""
        async def on_dial_back(msg: Any, ctx: Any) -> DialBackResult:
            remote = host.remote_ip(ctx.peer_id)
            ok = await dial_back(list(msg.addrs), remote)
            return DialBackResult(reachable=ok, seen_ip=remote or "")
        return on_dial_back

    def lease_or_end(self, handler: Any, peers: dict[str, Any]) -> Any:
        """``handler`` for lease requests, answered with ``RunEnded`` once the run is over."""
        async def lease(msg: Any, ctx: Any) -> Any:
            peer = peers.get(ctx.peer_id)
            if self.run_end.final is not None and peer is not None:
                return self.run_end.reply(ctx.peer_id, peer)
            return await handler(msg, ctx)
        return lease


class RunEnd:
    """The end-of-run notice: set once training is over, answered to each lease request."""

    def __init__(self, identity: Any, run_id: str) -> None:
        self.identity = identity
        self.run_id = run_id
        self.final: tuple[int, int] | None = None  # (version, steps) once the run is over
        self.told: set[str] = set()

    def reply(self, peer_id: str, record: Any) -> RunEnded:
        assert self.final is not None
        version, steps = self.final
        self.told.add(peer_id)
        return wire.sign(RunEnded(run_id=self.run_id, learner_peer_id=self.identity.peer_id, version=version,
                                  steps=steps, leases_done=record.leases_done, groups_accepted=record.groups_accepted,
                                  timestamp=time.time()), self.identity)

    async def announce(self, version: int, steps: int, live: Any, grace_s: float) -> None:
        """Mark the run over and wait (at most ``grace_s``) until every live node has asked for
        a lease and been told; ``live()`` lists the live peer ids."""
        self.final = (version, steps)
        with trio.move_on_after(grace_s):
            while set(live()) - self.told:
                await trio.sleep(0.1)
        missing = set(live()) - self.told
        log.info("run over at v%d: %d nodes told%s", version, len(self.told),
                 f", {len(missing)} not reached" if missing else "")


MULTISTREAM = b"/multistream/1.0.0\n"


async def dial_back(addrs: list[str], remote_ip: str | None, timeout_s: float = 2.0) -> bool:
    """Whether some advertised address of a node accepts a TCP connection from here and speaks
    libp2p (answers the multistream-select header). A node behind NAT advertises addresses of
    its private network, which fail; such a node must be a broadcast leaf (children dial their
    parents). Only addresses on ``remote_ip`` (where the node's connection comes from) are
    dialed, so a join cannot make the learner connect to third parties; at most 8, in
    parallel, the first success ends the others."""
    from echorl.net.addrs import tcp_endpoint

    endpoints = [e for e in (tcp_endpoint(a) for a in addrs[:16]) if e is not None and e[0] == remote_ip][:8]
    ok = False
    async with trio.open_nursery() as nursery:
        async def probe(host: str, port: int) -> None:
            nonlocal ok
            if await _speaks_libp2p(host, port, timeout_s):
                ok = True
                nursery.cancel_scope.cancel()

        for host, port in endpoints:
            nursery.start_soon(probe, host, port)
    return ok


async def _speaks_libp2p(host: str, port: int, timeout_s: float) -> bool:
    got = b""
    with trio.move_on_after(timeout_s):
        try:
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(bytes([len(MULTISTREAM)]) + MULTISTREAM)
                while MULTISTREAM not in got and len(got) < 256:
                    chunk = await stream.receive_some(256)
                    if not chunk:
                        break
                    got += chunk
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
    return MULTISTREAM in got
