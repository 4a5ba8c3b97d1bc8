"""The libp2p host wrapper every echorl peer uses: robust request/response over py-libp2p 0.8.1.

* ``route(protocol, handler, ...)`` / ``serve({protocol: handler})`` serve ``/echorl/<name>/1``
  (``net/serving.py``: ``RouteServer``, request caps, rate limits, deadlines, ``admit(peer_id)``
  asked before any body is read, strikes for peers that keep being refused).
* ``request(peer, protocol, msg)`` reuses pooled streams (a reused stream costs ~2 ms, a new one
  ~8 ms), retries once on a fresh stream when a pooled one turns out dead, and raises
  ``RemoteError`` for an ``Error`` reply, ``PeerUnavailable`` for network failures and timeouts.
* Dialing: ``max_connections_per_peer=1`` ends py-libp2p's fixed 0.25 s happy-eyeballs wait as
  soon as the first dial succeeds; connections are reused by the swarm.
* ``ping(peer)``: liveness probe with a deadline (a frozen peer raises no error by itself).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.host.ping import perform_ping_roundtrip
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from echorl.net.addrs import advertised_addrs, dial_reason, parse_peer_addr
from echorl.net.framing import (
    STREAM_ERRORS,
    CleanEnd,
    Truncated,
    close_quietly,
    protocol_error_from,
    read_frame,
    reset_quietly,
)
from echorl.net.guard import (
    ConnectionGuard,
    ConnectionLimits,
    PinnedPeerStore,
    RefusalStrikes,
    contain_stream_errors,
    guard_libp2p_inbound,
    no_auto_dial,
    no_pruning,
    raise_fd_limit,
    resource_manager,
)
from echorl.net.serving import HostStats, RequestContext, RouteServer
from echorl.protocol import limits, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity, short_id
from echorl.protocol.messages import Error, Message

log = logging.getLogger(__name__)

MAX_NOTED_PEERS = 2 * limits.MAX_PLAN_MEMBERS
"""Addresses noted for later dials (``note_peer_addrs``): the members of two full plans."""


class RemoteError(ProtocolError):
    """The remote peer answered with ``Error(code, detail)``."""


class PeerUnavailable(Exception):
    """The peer could not be reached, reset the stream, died mid-reply or missed a deadline."""


class DialFailed(PeerUnavailable):
    """A dial failed; ``reason`` says why in words a user can act on (``net/addrs.dial_reason``)."""

    def __init__(self, addr: str, reason: str) -> None:
        self.addr = addr
        self.reason = reason
        super().__init__(f"cannot reach {addr}: {reason}")


@dataclass(frozen=True)
class HostConfig:
    listen: str = "/ip4/127.0.0.1/tcp/0"
    announce: tuple[str, ...] = ()  # public addresses advertised before the interface ones
    io_timeout_s: float = 15.0  # one frame once its first byte arrived / one write
    idle_timeout_s: float = 60.0  # a served stream waits this long for its next request
    request_timeout_s: float = 30.0  # default deadline of request(): dial + write + reply
    connect_timeout_s: float = 10.0
    handler_timeout_s: float = 60.0  # default deadline of a handler
    pool_idle_s: float = 20.0  # pooled client streams older than this are not reused
    max_streams_per_peer: int = 16  # concurrent inbound streams per peer
    handshake_timeout_s: float = 5.0  # an inbound connection's security + muxer handshake
    #: opening a stream, either side: multistream negotiation of its protocol. py-libp2p's own
    #: 10 s undercut ``request_timeout_s``: a learner holding 1,000 peers on a saturated core is
    #: seconds late on each of a new connection's turns (Noise, identify, negotiation), and a
    #: status read there failed at py-libp2p's 10 s with 20 s of echorl's deadline left
    #: (bench/swarm.py). A stream that never negotiates still ends at this bound.
    negotiate_timeout_s: float = 30.0
    connection_limits: ConnectionLimits = ConnectionLimits()  # inbound connections per address / in all


class Host:
    """One echorl peer on libp2p. Create with :func:`open_host`."""

    def __init__(self, identity: Identity, lp_host: Any, config: HostConfig) -> None:
        self.identity = identity
        self.peer_id = identity.peer_id
        self.libp2p = lp_host
        self.config = config
        self._pool: dict[tuple[str, str], list[tuple[Any, float]]] = defaultdict(list)
        self._noted: dict[str, tuple[str, ...]] = {}  # peer -> addresses not yet in the peerstore
        self.guard = ConnectionGuard(config.connection_limits)  # inbound connections (net/guard.py)
        self.serving = RouteServer(self)  # the routes this peer serves (net/serving.py)
        self.route = self.serving.route  # serve one stream id with a handler
        self.serve = self.serving.serve  # serve a {stream id: handler} table (protocol/routes.py)

    @property
    def stats(self) -> HostStats:
        return self.serving.stats

    @property
    def strikes(self) -> RefusalStrikes:
        return self.serving.strikes

    # --- addresses and dialing ------------------------------------------------------------------
    @property
    def addrs(self) -> list[str]:
        """What others dial, each with ``/p2p/<peer id>``: ``announce`` first, then the bound
        addresses with a wildcard replaced by the interface addresses (``net/addrs.py``)."""
        bound = [str(a) for a in self.libp2p.get_transport_addrs()]
        return advertised_addrs(bound, self.config.announce, self.peer_id)

    def remote_ip(self, peer_id: str) -> str | None:
        """The IP address our connection to ``peer_id`` comes from (None if not connected)."""
        for conn in self.libp2p.get_network().get_connections(ID.from_base58(peer_id)):
            get_remote = getattr(getattr(conn, "muxed_conn", None), "get_remote_address", None)
            remote = get_remote() if callable(get_remote) else None
            if isinstance(remote, tuple) and len(remote) == 2:
                return str(remote[0])
        return None

    def observed_addrs(self) -> list[str]:
        """Our addresses as connected peers saw them (identify's observed address; empty on
        loopback). For a node behind NAT this is the NAT's public side, not a listen address."""
        mgr = getattr(self.libp2p, "_observed_addr_manager", None)
        try:
            return [str(a) for a in mgr.addrs(min_observers=1)] if mgr is not None else []
        except Exception:
            return []

    def note_peer_addrs(self, peer_id: str, addrs: list[str] | tuple[str, ...]) -> None:
        """``add_peer_addrs`` deferred to the first dial of ``peer_id``: for the member lists of
        announcements (up to ``MAX_PLAN_MEMBERS``), of which a peer dials a few. Parsing an
        address into the peerstore costs ~0.2 ms; at 10,000 members that was 2 s of event loop
        per version. The newest ``MAX_NOTED_PEERS`` notes are kept."""
        if not addrs:
            return
        self._noted.pop(peer_id, None)
        self._noted[peer_id] = tuple(addrs)
        while len(self._noted) > MAX_NOTED_PEERS:
            del self._noted[next(iter(self._noted))]

    def prepare_dial(self, peer_id: str) -> None:
        """Give the peerstore what ``note_peer_addrs`` kept for ``peer_id`` before a new stream
        may dial it; while a connection to it is up the note waits (the learner opens a stream
        to every member per version, over the connection each member joined on)."""
        if peer_id in self._noted and not self.is_connected(peer_id):
            self.add_peer_addrs(peer_id, list(self._noted[peer_id]))

    def add_peer_addrs(self, peer_id: str, addrs: list[str]) -> None:
        """Where ``peer_id`` is to be dialled (a join, an announce, a signed record): replaces
        what the peerstore held for it."""
        self._noted.pop(peer_id, None)
        maddrs = []
        for a in addrs:
            try:
                maddrs.append(multiaddr.Multiaddr(a.split("/p2p/")[0]))
            except Exception:
                log.debug("ignoring bad multiaddr %r", a)
        if maddrs:
            # the given addresses replace the stored ones: py-libp2p dials every stored address
            # and one dead one (identify's loopback, an old port) fails the dial to the good ones
            store = self.libp2p.get_peerstore()
            store.clear_addrs(ID.from_base58(peer_id))
            store.add_addrs(ID.from_base58(peer_id), maddrs, 0)
            cache = getattr(self.libp2p.get_network(), "_negative_peer_cache", None)
            if cache is not None:  # new addresses: an earlier failure says nothing about them
                cache.evict(peer_id)

    async def connect(self, addr: str, timeout: float | None = None) -> str:
        """Dial a ``/ip4/…/tcp/…/p2p/<id>`` address; returns the peer ID. Raises ``AddressError``
        (a ValueError) for a malformed address, ``DialFailed`` (a PeerUnavailable) with the cause."""
        info = info_from_p2p_addr(multiaddr.Multiaddr(parse_peer_addr(addr, "address")))
        cache = getattr(self.libp2p.get_network(), "_negative_peer_cache", None)
        if cache is not None:  # an explicit (re)connect must not be refused for an earlier failure
            cache.evict(str(info.peer_id))
        try:
            with trio.fail_after(timeout or self.config.connect_timeout_s):
                await self.libp2p.connect(info)
        except Exception as exc:
            self._forget_addrs(info.peer_id, info.addrs)
            raise DialFailed(addr, dial_reason(exc)) from None
        return str(info.peer_id)

    def _forget_addrs(self, peer: ID, failed: list[Any]) -> None:
        """Drop addresses that just failed from the peerstore: py-libp2p dials every stored
        address of a peer, and one dead address there fails later dials to its good ones."""
        store = self.libp2p.get_peerstore()
        bad = {str(a) for a in failed}
        try:
            keep = [a for a in store.addrs(peer) if str(a) not in bad]
        except Exception:
            return
        store.clear_addrs(peer)
        if keep:
            store.add_addrs(peer, keep, 120)

    def is_connected(self, peer_id: str) -> bool:
        return bool(self.libp2p.get_network().get_connections(ID.from_base58(peer_id)))

    async def disconnect(self, peer_id: str) -> None:
        self._drop_pool(peer_id)
        with trio.move_on_after(5.0):
            try:
                await self.libp2p.disconnect(ID.from_base58(peer_id))
            except Exception:
                pass

    def connected_peers(self) -> list[str]:
        return [str(p) for p in self.libp2p.get_connected_peers()]

    # --- requesting -----------------------------------------------------------------------------
    async def request(
        self,
        peer_id: str,
        protocol: str,
        msg: Message | bytes,
        *,
        expect: type[Message] | tuple[type[Message], ...] | None = None,
        timeout: float | None = None,
        max_reply_bytes: int = limits.MAX_FRAME_BYTES,
    ) -> Message:
        """Send ``msg`` (a message, or its ``wire.encode`` bytes: one encoding sent to many peers)
        and return the reply. Raises RemoteError (an Error reply, or a reply of an unexpected
        type / undecodable) or PeerUnavailable (network failure, deadline)."""
        payload = msg if isinstance(msg, bytes) else wire.encode(msg)
        deadline = timeout or self.config.request_timeout_s
        try:
            with trio.fail_after(deadline):
                for attempt in (0, 1):
                    stream, reused = await self._take_stream(peer_id, protocol)
                    try:
                        with trio.fail_after(deadline):
                            await stream.write(wire.frame(payload))
                            body = await read_frame(
                                stream,
                                max_bytes=max_reply_bytes,
                                first_byte_timeout=deadline,
                                io_timeout=self.config.io_timeout_s,
                            )
                    except (CleanEnd, Truncated, *STREAM_ERRORS) as exc:
                        await reset_quietly(stream)
                        if reused and attempt == 0:
                            continue  # a pooled stream the server had closed: one fresh try
                        raise PeerUnavailable(
                            f"{protocol} to {short_id(peer_id)}: {type(exc).__name__}: {exc}"
                        ) from None
                    except BaseException:
                        await reset_quietly(stream)
                        raise
                    break
        except trio.TooSlowError:
            raise PeerUnavailable(f"{protocol} to {short_id(peer_id)}: no reply within {deadline:.1f} s") from None
        except ProtocolError as exc:  # oversized reply header
            raise RemoteError(exc.code, f"reply: {exc.detail}") from None
        try:
            reply = wire.decode(body)
        except ProtocolError as exc:
            await reset_quietly(stream)
            raise RemoteError(exc.code, f"reply: {exc.detail}") from None
        await self._give_back(peer_id, protocol, stream)
        if isinstance(reply, Error):
            err = protocol_error_from(reply)
            raise RemoteError(err.code, err.detail)
        if expect is not None and not isinstance(reply, expect):
            raise RemoteError(ErrorCode.UNKNOWN_TYPE, f"unexpected reply {reply.type!r} on {protocol}")
        return reply

    async def _take_stream(self, peer_id: str, protocol: str) -> tuple[Any, bool]:
        pool = self._pool.get((peer_id, protocol))
        now = time.monotonic()
        while pool:
            stream, last = pool.pop()
            if now - last < self.config.pool_idle_s and not _closed(stream):
                return stream, True
            await close_quietly(stream)
        self.prepare_dial(peer_id)
        try:
            with trio.fail_after(self.config.connect_timeout_s + 5.0):
                stream = await self.libp2p.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])
        except trio.TooSlowError:
            raise PeerUnavailable(f"open {protocol} to {short_id(peer_id)}: timed out") from None
        except Exception as exc:
            raise PeerUnavailable(f"open {protocol} to {short_id(peer_id)}: {_chain(exc)}") from None
        return stream, False

    async def _give_back(self, peer_id: str, protocol: str, stream: Any) -> None:
        pool = self._pool[(peer_id, protocol)]
        if len(pool) < 4:
            pool.append((stream, time.monotonic()))
        else:
            await close_quietly(stream)

    def _drop_pool(self, peer_id: str) -> None:
        for key in [k for k in self._pool if k[0] == peer_id]:
            self._pool.pop(key, None)

    async def ping(self, peer_id: str, timeout: float = 5.0) -> float:
        """Seconds for a libp2p ping (stream open + round trip); PeerUnavailable if none within ``timeout``."""
        start = time.perf_counter()
        self.prepare_dial(peer_id)
        try:
            with trio.fail_after(timeout):
                stream = await self.libp2p.new_stream(ID.from_base58(peer_id), [PING_PROTOCOL])
                try:
                    await perform_ping_roundtrip(stream)
                finally:
                    await close_quietly(stream)
        except trio.TooSlowError:
            raise PeerUnavailable(f"ping {short_id(peer_id)}: no answer within {timeout:.1f} s") from None
        except Exception as exc:
            raise PeerUnavailable(f"ping {short_id(peer_id)}: {type(exc).__name__}: {exc}") from None
        return time.perf_counter() - start


NEGATIVE_CACHE_S = 2.0  # how long py-libp2p refuses redials of a peer after a failed dial


def _quiet_libp2p_logs() -> None:
    for name in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


@asynccontextmanager
async def open_host(identity: Identity, config: HostConfig | None = None) -> AsyncIterator[Host]:
    """Start a libp2p host (TCP, Noise, yamux) with ``identity``'s key, listening on
    ``config.listen``; stopped when the block exits."""
    config = config or HostConfig()
    _quiet_libp2p_logs()
    # one connection per peer: the dialer stops waiting as soon as the first dial succeeds;
    # no auto-connector dialing toward a connection target (our topology is explicit: the
    # watermarks alone do not stop it, see ``no_auto_dial``).
    # py-libp2p's cap on all connections (max_connections, 300 by default) sits above ours
    # (net/guard.py), and the process may open that many descriptors
    most = config.connection_limits.max_connections
    raise_fd_limit(most)
    conn_cfg = ConnectionConfig(
        max_connections=most,
        max_connections_per_peer=1,
        dial_timeout=config.connect_timeout_s,
        min_connections=0,
        low_watermark=0,
        inbound_upgrade_timeout=config.handshake_timeout_s,
        outbound_stream_protocol_negotiation_timeout=config.negotiate_timeout_s,
        inbound_stream_protocol_negotiation_timeout=config.negotiate_timeout_s,
    )
    listen = multiaddr.Multiaddr(config.listen)
    key_pair = create_new_key_pair(identity.seed)
    lp_host = new_host(
        key_pair=key_pair,
        listen_addrs=[listen],
        connection_config=conn_cfg,
        resource_manager=resource_manager(config.connection_limits),  # net/guard.py: above ours
        peerstore_opt=PinnedPeerStore(ID.from_pubkey(key_pair.public_key), config.connection_limits),
    )
    if str(lp_host.get_id()) != identity.peer_id:
        raise RuntimeError("libp2p peer id differs from the protocol identity")
    host = Host(identity, lp_host, config)
    guard_libp2p_inbound(lp_host.get_network(), host.guard)  # net/guard.py
    no_pruning(lp_host.get_network())  # net/guard.py: its pruner would close joined peers past 300
    no_auto_dial(lp_host.get_network())  # net/guard.py: it dialled every known peer toward 150
    contain_stream_errors(lp_host.get_network())  # net/guard.py: one failed stream, not the host
    cache = getattr(lp_host.get_network(), "_negative_peer_cache", None)
    if cache is not None and hasattr(cache, "_ttl"):
        # py-libp2p refuses every dial to a peer for 60 s after one failed: one early failure
        # (a peer not listening yet, a dial before its addresses were known) cut broadcast
        # edges for a whole version in the lab; our callers have their own deadlines and backoff
        cache._ttl = NEGATIVE_CACHE_S
    async with lp_host.run(listen_addrs=[listen]):
        yield host


def _chain(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` and of what it was raised from (py-libp2p's ``StreamFailure``
    names no reason; its cause — a negotiation timeout, a reset, a refused stream — does)."""
    parts, seen = [], 0
    cur: BaseException | None = exc
    while cur is not None and seen < 3:
        parts.append(f"{type(cur).__name__}: {cur}".rstrip(": "))
        cur, seen = cur.__cause__, seen + 1
    return " <- ".join(parts)


def _closed(stream: Any) -> bool:
    flag = getattr(stream, "is_closed", False)
    return bool(flag() if callable(flag) else flag)


__all__ = [
    "DialFailed",
    "Host",
    "HostConfig",
    "PeerUnavailable",
    "RemoteError",
    "RequestContext",  # what a handler is given (net/serving.py), named here for the peers that serve
    "open_host",
]
