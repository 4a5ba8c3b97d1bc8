"""The ticketed direct TCP chunk path: the same ``Chunk`` frames on a plain TCP connection, which
skips Noise + yamux (~16 CPU-s per GB) for raw TCP (< 1 CPU-s per GB). Chunks are verified
against the signed manifest exactly as on libp2p, so the path needs no encryption for them.

* Dialing end, ``DirectTransport.open``: ask the peer for a ticket over libp2p (authenticated:
  ``TICKET`` when a child pulls, ``PUSH`` when a parent pushes), connect to the ticket's port on
  **the IP of that authenticated libp2p connection** (``Host.remote_ip``; never an address the
  peer announced about itself, so a peer cannot point us at a third party), and send the
  ticket's proof: ``ticket_proof`` (a hash, so the bytes we send are not the peer's choice).
* Serving end, ``TicketBook``: issues fixed-length single-use tickets, each bound to the peer it
  was issued to and to what its connection is for (a callback), bounded in number and time.
  ``DirectListener``: the direct port, a listener that takes a handler (as trio's
  ``serve_listeners``): a per-address connection guard (``net/guard.py``), the proof within the
  handshake deadline, then the handler (``TicketBook.admit``: the ticket's callback, or close).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable

import trio

from echorl.net.guard import ConnectionGuard, remote_ip
from echorl.net.host import Host, PeerUnavailable
from echorl.net.transport.base import ChunkStream, ChunkTransport, FramedStream
from echorl.net.transport.pacing import UploadLimiter
from echorl.protocol import limits
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import StreamTicket, Subscribe

log = logging.getLogger(__name__)

PROOF_BYTES = 16  # what a direct connection sends first: the ticket's proof
_PROOF_DOMAIN = b"echorl/direct-ticket/1\0"
TICKET_TTL_S = 30.0  # an unused ticket expires (a child dials within seconds of getting it)
MAX_OPEN_TICKETS = 1024  # per peer process: beyond it, ticket requests are refused (rate_limited)

#: what a redeemed ticket's connection is for (serve a stripe, or hand a pushed one over)
OnConnect = Callable[[ChunkStream], Awaitable[None]]
DirectHandler = Callable[[bytes, ChunkStream], Awaitable[None]]


def ticket_proof(ticket: bytes) -> bytes:
    """What the dialer sends for ``ticket``: SHA-256 of a fixed domain and the ticket, first
    ``PROOF_BYTES``. The issuer knows the ticket, so it can check the proof; a hostile issuer
    chose the ticket but cannot choose the proof's bytes (protocol smuggling to another service)."""
    return hashlib.sha256(_PROOF_DOMAIN + ticket).digest()[:PROOF_BYTES]


class TcpStreamAdapter:
    """A trio TCP stream with the small libp2p-stream surface ``read_frame`` and
    ``write_paced`` use (``read``, ``write``, ``close``, ``reset``). ``write`` takes any
    bytes-like object, so paced writes hand it views instead of copies."""

    accepts_views = True

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def read(self, n: int) -> bytes:
        return await self.stream.receive_some(n)

    async def write(self, data: bytes | memoryview) -> None:
        await self.stream.send_all(data)

    async def close(self) -> None:
        await self.stream.aclose()

    async def reset(self) -> None:
        await trio.aclose_forcefully(self.stream)


class DirectTransport(ChunkTransport):
    """Open a chunk stream on the peer's direct TCP port, with a ticket asked for on ``ticket_route``."""

    name = "direct"

    def __init__(
        self, host: Host, ticket_route: str, limiter: UploadLimiter, io_timeout: float, ticket_timeout_s: float
    ) -> None:
        self.host = host
        self.ticket_route = ticket_route
        self.limiter = limiter
        self.io_timeout = io_timeout
        self.ticket_timeout_s = ticket_timeout_s

    async def open(self, peer: str, request: Subscribe) -> ChunkStream:
        reply = await self.host.request(
            peer, self.ticket_route, request, expect=StreamTicket, timeout=self.ticket_timeout_s
        )
        assert isinstance(reply, StreamTicket)
        ip = self.host.remote_ip(peer)  # the authenticated connection's IP: never one it announced
        if ip is None:
            raise PeerUnavailable(f"direct path to {short_id(peer)}: no connection address")
        try:
            with trio.fail_after(self.io_timeout):
                tcp = await trio.open_tcp_stream(ip, reply.port)
                await tcp.send_all(ticket_proof(reply.ticket))
        except (trio.TooSlowError, OSError, trio.BrokenResourceError) as exc:
            raise PeerUnavailable(f"direct {ip}:{reply.port}: {type(exc).__name__}: {exc}") from None
        return _DirectStream(TcpStreamAdapter(tcp), self.io_timeout, self.limiter)


class _DirectStream(FramedStream):
    """The dialer's end: abandoning it closes the socket at once."""

    async def aclose(self) -> None:
        await self.stream.reset()


class TicketBook:
    """The direct port's open tickets (see module doc); ``admit`` is the listener's handler."""

    def __init__(self, ttl_s: float = TICKET_TTL_S, max_open: int = MAX_OPEN_TICKETS) -> None:
        self.ttl_s = ttl_s
        self.max_open = max_open
        self._open: dict[bytes, tuple[str, OnConnect, float]] = {}  # proof -> (peer, callback, expiry)

    def issue(self, peer: str, on_connect: OnConnect) -> bytes:
        """A fresh ticket for ``peer``; its connection runs ``on_connect``. Raises
        ``ProtocolError(rate_limited)`` while ``max_open`` tickets are open."""
        now = time.monotonic()
        for proof, (_, _, expiry) in list(self._open.items()):
            if expiry < now:
                del self._open[proof]
        if len(self._open) >= self.max_open:
            raise ProtocolError(ErrorCode.RATE_LIMITED, "too many open tickets")
        ticket = os.urandom(limits.TICKET_BYTES)
        self._open[ticket_proof(ticket)] = (peer, on_connect, now + self.ttl_s)
        return ticket

    def redeem(self, proof: bytes) -> OnConnect | None:
        """The callback of an open ticket with this proof (the ticket is used up), else None."""
        entry = self._open.pop(proof, None)
        if entry is None or entry[2] < time.monotonic():
            return None
        return entry[1]

    async def admit(self, proof: bytes, stream: ChunkStream) -> None:
        on_connect = self.redeem(proof)
        if on_connect is not None:
            await on_connect(stream)


class DirectListener:
    """The direct TCP chunk port (see module doc). ``port`` is set while ``serve`` runs."""

    def __init__(
        self,
        handler: DirectHandler,
        guard: ConnectionGuard,
        *,
        handshake_timeout_s: float,
        limiter: UploadLimiter,
        io_timeout: float,
    ) -> None:
        self.handler = handler
        self.guard = guard
        self.handshake_timeout_s = handshake_timeout_s
        self.limiter = limiter
        self.io_timeout = io_timeout
        self.port: int | None = None

    async def serve(self, listen_ip: str = "127.0.0.1", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``listen_ip`` (an ephemeral port, passed to ``task_status``) until cancelled."""
        listeners = await trio.open_tcp_listeners(0, host=listen_ip)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        try:
            await trio.serve_listeners(self._on_connection, listeners)
        finally:
            self.port = None

    async def _on_connection(self, tcp: trio.SocketStream) -> None:
        ip = remote_ip(tcp)
        with self.guard.slot(ip) as ok:
            try:
                if ok:
                    await self._serve(tcp)
            except Exception as exc:
                log.info("direct connection from %s ended: %s: %s", ip, type(exc).__name__, exc)
            finally:
                await trio.aclose_forcefully(tcp)

    async def _serve(self, tcp: trio.SocketStream) -> None:
        """The proof within the handshake deadline, then the handler."""
        proof = b""
        with trio.fail_after(self.handshake_timeout_s):
            while len(proof) < PROOF_BYTES:
                more = await tcp.receive_some(PROOF_BYTES - len(proof))
                if not more:
                    return
                proof += more
        await self.handler(proof, FramedStream(TcpStreamAdapter(tcp), self.io_timeout, self.limiter))


def listen_ip(host: Host) -> str:
    """Where this peer's direct port listens: the first IPv4 address it advertises (loopback if none)."""
    for addr in host.addrs:
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
    return "127.0.0.1"
