"""Accept-side connection limits: what one address may hold open on a peer, so many connections
from one host (half-open handshakes, idle sockets) cannot take every slot and honest peers can
always connect.

``ConnectionGuard`` counts open inbound connections per address (an IPv4 address, an IPv6
address by its /64: ``ip_key``) and in total; a connection past ``max_per_ip`` or ``max_total`` is
closed at once, before any handshake work, and counted (``refused``). It guards libp2p's inbound
connections (``guard_libp2p_inbound``: around py-libp2p's accept handler, which holds a slot for
the connection's whole life; its security + muxer handshake has ``inbound_upgrade_timeout``,
``HostConfig.handshake_timeout_s``) and the direct TCP chunk port (``net/transport/direct_tcp.py``,
whose ticket proof must arrive within the same deadline).

py-libp2p 0.8.1 also ships ``libp2p/rcmgr`` (a resource manager with per-IP limits), but its
inbound admission "fails open" on any internal error and its limits are process-wide defaults
tuned for DHT crawls; this guard is twenty lines whose limits are ours and tested. What this
module keeps of py-libp2p's own caps sits above the guard's: ``resource_manager``, the peer store
(``PinnedPeerStore``: sized by the connection bound, the host's own key never evicted), no pruner,
no auto-dialer, and an error in one of py-libp2p's own stream handlers ends that stream, not the
host (``contain_stream_errors``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStore

from echorl.net.hostkey import ip_key

log = logging.getLogger(__name__)


#: open inbound connections in all, by default. Sized for a learner holding 1,000+ joined peers:
#: each keeps one connection (pings, leases and submissions share it), and status readers, doctor
#: probes and reconnects racing their old socket's close need room beside them; 4x the 1,000-peer
#: target. What it bounds is memory and descriptors (an idle libp2p connection is tens of KiB on
#: the learner; bench/swarm.py measures RSS per peer), not per-address floods (``max_per_ip``).
MAX_INBOUND_CONNECTIONS = 4096
#: connections a host dials itself beside its inbound ones (relay parents, dial-backs, a node's
#: learner): py-libp2p's own cap counts both directions (``ConnectionConfig.max_connections``).
OUTBOUND_HEADROOM = 256
#: descriptors a process needs beside its sockets (model files, threads, pipes, the metrics sink)
FD_SPARE = 256


@dataclass(frozen=True)
class ConnectionLimits:
    max_total: int = MAX_INBOUND_CONNECTIONS  # open inbound connections in all
    max_per_ip: int = 48  # ... from one address (more than the learner's joins per address)

    @property
    def max_connections(self) -> int:
        """py-libp2p's cap on all of a host's connections (inbound and outbound): ours plus
        the outbound headroom, so its own cap (300 by default) never refuses before ours."""
        return self.max_total + OUTBOUND_HEADROOM


_fd_warned = False


def raise_fd_limit(connections: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE (towards the hard limit) to what ``connections``
    sockets need plus ``FD_SPARE``; one warning line (once per process) if the hard limit is
    lower. Returns the soft limit now in force. A default soft limit of 1,024 would otherwise
    stop a learner near 1,000 peers with ``OSError: Too many open files`` at accept."""
    global _fd_warned
    try:
        import resource
    except ImportError:  # not a POSIX system
        return -1
    need = connections + FD_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need and not _fd_warned:
        _fd_warned = True
        log.warning(
            "open-file limit %d is below the %d that %d connections need: raise it (ulimit -n / "
            "LimitNOFILE) or this peer refuses connections past ~%d",
            soft,
            need,
            connections,
            max(0, soft - FD_SPARE),
        )
    return int(soft)


class ConnectionGuard:
    MAX_BANNED = 4096

    def __init__(self, limits: ConnectionLimits | None = None) -> None:
        self.limits = limits or ConnectionLimits()
        self.per_ip: dict[str, int] = {}
        self.total = 0
        self.refused = 0
        self._banned: dict[str, float] = {}  # ip_key -> refused until (time.monotonic)

    def ban(self, ip: str | None, seconds: float) -> None:
        """Refuse every new connection from ``ip`` (its /64 for IPv6) for ``seconds``: a host
        whose peer was struck off (``RefusalStrikes``) cannot come back under a fresh identity,
        each try costing us a handshake."""
        key = ip_key(ip)
        if not key:
            return
        if len(self._banned) >= self.MAX_BANNED and key not in self._banned:
            self._banned.pop(next(iter(self._banned)))
        self._banned[key] = time.monotonic() + seconds

    def banned(self, ip: str | None) -> bool:
        key = ip_key(ip)
        until = self._banned.get(key)
        if until is not None and until <= time.monotonic():
            del self._banned[key]
            return False
        return until is not None

    def try_open(self, ip: str | None) -> bool:
        """Take a slot for a connection from ``ip``; False (counted) if none is free or ``ip``
        is banned."""
        key = ip_key(ip)
        if self.total >= self.limits.max_total or self.per_ip.get(key, 0) >= self.limits.max_per_ip or self.banned(ip):
            self.refused += 1
            return False
        self.per_ip[key] = self.per_ip.get(key, 0) + 1
        self.total += 1
        return True

    def close(self, ip: str | None) -> None:
        key = ip_key(ip)
        left = self.per_ip.get(key, 0) - 1
        if left > 0:
            self.per_ip[key] = left
        else:
            self.per_ip.pop(key, None)
        self.total = max(0, self.total - 1)

    @contextmanager
    def slot(self, ip: str | None) -> Iterator[bool]:
        """``with guard.slot(ip) as ok:`` a slot held for the block (``ok`` False: refused)."""
        ok = self.try_open(ip)
        try:
            yield ok
        finally:
            if ok:
                self.close(ip)


def remote_ip(conn: Any) -> str | None:
    """The remote IP of a raw connection or trio socket stream (None if unknown)."""
    get = getattr(conn, "get_remote_address", None)
    try:
        if callable(get):
            addr = get()
        else:
            addr = conn.socket.getpeername()
    except (OSError, AttributeError):
        return None
    return str(addr[0]) if isinstance(addr, tuple) and addr else None


def _socket_of(conn: Any) -> Any:
    """The trio socket under a py-libp2p raw TCP connection (None for other transports)."""
    return getattr(getattr(conn, "stream", None), "socket", None)


#: how often a guarded connection's socket is looked at, for a close that bypassed the connection's
#: ``close()`` (the usual close sets an event at once): every look is a deadline the loop expires,
#: and at 1 s a learner holding 1,000 connections spent ~12 % of its samples expiring them
#: (py-spy on bench/swarm.py --peers 1000)
CLOSED_POLL_S = 15.0


def _signal_on_close(conn: Any, closed: trio.Event) -> None:
    """Set ``closed`` once ``conn.close()`` has run (however it ended)."""
    close = conn.close

    async def close_then_signal() -> None:
        try:
            await close()
        finally:
            closed.set()

    conn.close = close_then_signal


async def _until_closed(sock: Any, closed: trio.Event, poll_s: float) -> None:
    while sock.fileno() != -1 and not closed.is_set():
        with trio.move_on_after(poll_s):
            await closed.wait()


def guard_libp2p_inbound(swarm: Any, guard: ConnectionGuard, poll_s: float = CLOSED_POLL_S) -> None:
    """Put ``guard`` in front of py-libp2p's inbound connection handler (looked up on the swarm
    at each accept, so wrapping the instance attribute covers every listener). py-libp2p's
    handler never returns while the swarm runs (it parks on the swarm's lifetime after the
    upgrade), so the slot is released, and the parked handler cancelled, once the connection is
    closed: at once when its ``close()`` ran (py-libp2p closes the raw connection last, whichever
    side hung up), else when its socket is seen closed (every ``poll_s``)."""
    inner = swarm._handle_inbound_connection

    async def guarded(conn: Any, maddr: Any) -> None:
        ip = remote_ip(conn)
        with guard.slot(ip) as ok:
            if not ok:
                log.debug("inbound connection from %s refused: connection limit", ip)
                try:
                    await conn.close()
                except Exception:
                    pass
                return
            sock = _socket_of(conn)
            if sock is None:
                await inner(conn, maddr)
                return
            closed = trio.Event()
            _signal_on_close(conn, closed)
            async with trio.open_nursery() as nursery:

                async def serve() -> None:
                    await inner(conn, maddr)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(serve)
                await _until_closed(sock, closed, poll_s)
                nursery.cancel_scope.cancel()

    swarm._handle_inbound_connection = guarded


#: handshakes in flight on a host (py-libp2p's resource manager counts them as pending: 64 by
#: default): a burst of joiners (a restart, a swarm bench) waits in the listen backlog past that;
#: the handshake deadline and the per-address cap bound what half-open connections can hold
MAX_PENDING_INBOUND = 256
#: streams per connection py-libp2p's resource manager allows in all (10,000 by default, a cap a
#: thousand peers with pooled lease/submit/ping streams would reach); per-stream limits are ours
STREAMS_PER_CONNECTION = 16


def resource_manager(limits: ConnectionLimits) -> Any:
    """py-libp2p's resource manager sized above ``limits``: by default it admits 256 established
    inbound connections and 1,000 in all, so a learner stopped accepting joins at its 256th peer
    with a handshake it closed (bench/swarm.py at 300 peers); the guard above is the policy, this
    only keeps py-libp2p's own caps out of its way."""
    from libp2p.rcmgr import ResourceManager
    from libp2p.rcmgr.connection_limits import ConnectionLimits as Libp2pLimits
    from libp2p.rcmgr.manager import ResourceLimits

    most = limits.max_connections
    return ResourceManager(
        limits=ResourceLimits(max_connections=most, max_streams=STREAMS_PER_CONNECTION * most),
        connection_limits=Libp2pLimits(
            max_pending_inbound=MAX_PENDING_INBOUND,
            max_pending_outbound=OUTBOUND_HEADROOM,
            max_established_inbound=limits.max_total,
            max_established_outbound=OUTBOUND_HEADROOM,
            max_established_per_peer=8,
            max_established_total=most,
        ),
    )


#: peers a host's peer store keeps per connection it may hold: py-libp2p's store keeps 1,000 and
#: past that evicts entries without addresses first, the host's own key among them
PEERS_KEPT_PER_CONNECTION = 2


class PinnedPeerStore(PeerStore):
    """py-libp2p's peer store sized above ``limits`` and never evicting the host itself.

    py-libp2p's ``PeerStore`` evicts past 1,000 peers, entries without addresses first; the host's
    own entry (its key pair, no address) went first, and the next identify request raised
    ``PeerStoreError`` out of the connection's nursery and ended the host: a learner holding
    1,000 peers exited on the first status read (bench/swarm.py)."""

    def __init__(self, own: ID, limits: ConnectionLimits) -> None:
        most = PEERS_KEPT_PER_CONNECTION * limits.max_connections
        super().__init__(max_records=most, max_peers=most)
        self._own = own

    def _enforce_peer_limit(self) -> None:
        own = self.peer_data_map.pop(self._own, None)
        try:
            super()._enforce_peer_limit()
        finally:
            if own is not None:
                self.peer_data_map[self._own] = own


def contain_stream_errors(swarm: Any) -> None:
    """An exception raised while py-libp2p serves one inbound stream (its own handlers: identify,
    ping, negotiation) ends that stream, not the host: raised, it left the connection's nursery
    and the swarm's, and a learner exited (the peer store's ``PeerStoreError`` above). echorl's
    handlers have their own guard (``net/serving.py``); this one is for py-libp2p's."""
    inner = swarm.common_stream_handler

    async def contained(stream: Any) -> None:
        try:
            await inner(stream)
        except Exception as exc:  # trio's Cancelled is a BaseException and passes through
            proto = getattr(stream, "get_protocol", lambda: None)()
            log.warning("an inbound %s stream failed inside py-libp2p: %s: %s", proto, type(exc).__name__, exc)
            try:
                await stream.reset()
            except Exception:
                pass

    swarm.set_stream_handler(contained)


def no_auto_dial(swarm: Any) -> None:
    """Turn off py-libp2p's auto-connector on ``swarm``: it dials peers from the peer store
    toward the midpoint of the watermarks (150 connections with ``low_watermark`` 0 and the
    default ``high_watermark`` 300), every 30 s and 5 s after any disconnect, so an honest node
    dialled every address it had learnt (plan members, the learner's members: a crowd of idle
    identities cost the honest nodes' CPU), and a learner its members. Every connection echorl
    needs is dialled by the code that needs it (join, broadcast, fetch)."""
    connector = getattr(swarm, "auto_connector", None)
    if connector is not None:

        async def dial_nothing() -> None:
            return None

        connector.maybe_connect = dial_nothing


def no_pruning(swarm: Any) -> None:
    """Turn off py-libp2p's connection pruner on ``swarm``: past ``high_watermark`` (300 by
    default) it closes the lowest-valued connections 20 at a time after each new one, which on a
    learner are joined peers (the guard above bounds what a host holds)."""
    pruner = getattr(swarm, "connection_pruner", None)
    if pruner is not None:

        async def keep_all() -> None:
            return None

        pruner.maybe_prune_connections = keep_all


class RefusalStrikes:
    """Peers that keep opening streams they are not admitted on (a stranger hammering SUBMIT):
    past ``limit`` refusals within ``window_s`` a peer is struck off for ``ban_s`` — its streams
    are reset before any reply is written and its connection is closed, and its address is banned
    from connecting for as long (``ConnectionGuard.ban``) unless an admitted peer shares it (the
    host decides: ``Host._strike``). Bounded memory: at most ``max_peers`` peers are tracked."""

    def __init__(self, limit: int = 32, window_s: float = 10.0, ban_s: float = 60.0, max_peers: int = 4096) -> None:
        self.limit, self.window_s, self.ban_s, self.max_peers = limit, window_s, ban_s, max_peers
        self._count: dict[str, tuple[float, int]] = {}  # peer -> (window start, refusals in it)
        self._banned: dict[str, float] = {}  # peer -> struck off until
        self.struck = 0

    def banned(self, peer: str, now: float) -> bool:
        until = self._banned.get(peer)
        if until is not None and until <= now:
            del self._banned[peer]
            return False
        return until is not None

    def refuse(self, peer: str, now: float) -> bool:
        """Count one refusal; True when this one strikes the peer off."""
        start, n = self._count.get(peer, (now, 0))
        if now - start > self.window_s:
            start, n = now, 0
        if len(self._count) >= self.max_peers and peer not in self._count:
            self._count.clear()  # a flood of identities: start over rather than grow
        self._count[peer] = (start, n + 1)
        if n + 1 < self.limit:
            return False
        self.strike_off(peer, now)
        return True

    def strike_off(self, peer: str, now: float) -> None:
        """Strike ``peer`` off at once, for what no honest peer ever sends (a forged signature)."""
        self._count.pop(peer, None)
        if len(self._banned) >= self.max_peers:
            self._banned.pop(next(iter(self._banned)))
        self._banned[peer] = now + self.ban_s
        self.struck += 1
