"""Pushed edges of the broadcast plan: a parent behind NAT cannot be dialled, so it dials its
(reachable) plan child and pushes its stripe to it (``BroadcastPlan.pushed``). This is what
lets a NAT'd node's uplink carry the broadcast instead of idling as a leaf.

Parent side, ``Pusher.push``: ask the child for a push ticket (``PUSH``: a ``Subscribe`` naming
version and stripe), open a TCP connection to the child's direct chunk port, present the
ticket, then write the stripe's ``Chunk`` frames exactly as for a pulled edge
(``ChunkServer.serve_stripe``). Without a direct port at the child, the same frames go over a
libp2p stream the parent opens (``PUSH_STREAM``, first frame the ``Subscribe``).

Child side, ``PushInbox``: issues tickets only to the peer its plan names as the pushing parent
of that stripe (the caller is authenticated by libp2p; the ticket binds the TCP connection to
it, and every chunk is verified against the signed manifest anyway), and hands the accepted
connection to the receiving task, which reads it like a pulled stream.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from echorl.protocol import wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import Message, StreamTicket, Subscribe
from echorl.protocol.routes import PUSH, PUSH_STREAM, ROUTES

from echorl.broadcast.chunk_server import ChunkServer
from echorl.broadcast.store import VersionState
from echorl.net.framing import read_frame, reset_quietly
from echorl.net.host import PeerUnavailable, RemoteError, RequestContext
from echorl.net.transport import Libp2pTransport, _Libp2pSource, ip_of, open_direct, serve_raw
from echorl.protocol.identity import short_id

log = logging.getLogger("echorl.broadcast.push")

MAX_SLOTS = 256  # (version, stripe) hand-overs waiting at once
TICKET_S = 30.0


@dataclass
class _Slot:
    """One (version, stripe) hand-over: the pushing parent's stream, once it arrives."""

    parent: str
    arrived: trio.Event = field(default_factory=trio.Event)
    finished: trio.Event = field(default_factory=trio.Event)
    stream: Any = None


class PushedSource(_Libp2pSource):
    """The child's end of a pushed stripe: the frames of the parent's stream (a libp2p stream
    or a ``TcpStreamAdapter``); ``aclose`` lets the connection go (its acceptor closes it)."""

    def __init__(self, slot: _Slot, io_timeout: float) -> None:
        super().__init__(slot.stream, io_timeout)
        self._slot = slot

    async def aclose(self) -> None:
        self._slot.finished.set()


class PushInbox:
    """The child side: push tickets for its plan parents on pushed edges, and the hand-over of
    their connections to ``wait``."""

    def __init__(self, server: ChunkServer) -> None:
        self.server = server
        self._tickets: dict[bytes, tuple[str, int, int, float]] = {}
        self._slots: dict[tuple[int, int], _Slot] = {}

    def install(self) -> None:
        self.server.host.serve({PUSH: self._on_ticket})
        serve_raw(self.server.host, PUSH_STREAM, self._on_stream)
        self.server.accept_pushed = self._accept_direct

    async def _check(self, sub: Subscribe, peer: str) -> VersionState:
        if sub.run_id != self.server.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "other run")
        state = await self.server.state_for(sub.version)
        if state is None or sub.stripe >= state.n_stripes:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no stripe {sub.stripe} of v{sub.version} here")
        if state.parents.get(sub.stripe) != peer or not state.plan.pushed(peer, state.me):
            raise ProtocolError(ErrorCode.NOT_FOUND, f"{short_id(peer)} is not my pushing parent in stripe {sub.stripe}")
        return state

    def _slot(self, version: int, stripe: int, parent: str) -> _Slot:
        key = (version, stripe)
        slot = self._slots.get(key)
        if slot is None:
            for old in [k for k in self._slots if k[0] not in self.server.states]:
                del self._slots[old]
            if len(self._slots) >= MAX_SLOTS:
                raise ProtocolError(ErrorCode.RATE_LIMITED, "too many pushed stripes waiting")
            slot = self._slots[key] = _Slot(parent)
        if slot.parent != parent:
            raise ProtocolError(ErrorCode.NOT_FOUND, "another parent pushes this stripe")
        return slot

    async def _on_ticket(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, Subscribe)
        if self.server.direct_port is None:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "no direct path here")
        await self._check(msg, ctx.peer_id)
        now = time.monotonic()
        for t, entry in list(self._tickets.items()):
            if entry[3] < now:
                del self._tickets[t]
        if len(self._tickets) > 1024:
            raise ProtocolError(ErrorCode.RATE_LIMITED, "too many open tickets")
        ticket = os.urandom(16)
        self._tickets[ticket] = (ctx.peer_id, msg.version, msg.stripe, now + TICKET_S)
        return StreamTicket(ticket=ticket, port=self.server.direct_port)

    async def _accept_direct(self, ticket: bytes, stream: Any) -> bool:
        """ChunkServer's direct listener found no pull ticket: a push ticket? Then hand the
        connection over and hold it open until the receiver is done with it."""
        entry = self._tickets.pop(ticket, None)
        if entry is None or entry[3] < time.monotonic():
            return False
        parent, version, stripe, _ = entry
        await self._hand_over(self._slot(version, stripe, parent), stream, version, stripe)
        return True

    async def _on_stream(self, stream: Any, peer: str) -> None:
        body = await read_frame(stream, max_bytes=ROUTES[PUSH_STREAM].max_request_bytes,
                                first_byte_timeout=10.0, io_timeout=10.0)
        sub = wire.decode(body, expect=Subscribe)
        assert isinstance(sub, Subscribe)
        await self._check(sub, peer)
        try:
            await self._hand_over(self._slot(sub.version, sub.stripe, peer), stream, sub.version, sub.stripe)
        finally:
            await reset_quietly(stream)

    async def _hand_over(self, slot: _Slot, stream: Any, version: int, stripe: int) -> None:
        """Give ``stream`` to the waiting receiver; return when it is done with it."""
        if slot.arrived.is_set():
            raise ProtocolError(ErrorCode.NOT_FOUND, "this stripe was pushed already")
        slot.stream = stream
        slot.arrived.set()
        state = self.server.states.get(version)
        with trio.move_on_after(self.server.stripe_deadline(state, stripe) if state else TICKET_S):
            await slot.finished.wait()
        self._slots.pop((version, stripe), None)

    async def wait(self, state: VersionState, stripe: int, parent: str, timeout: float) -> PushedSource:
        """The pushed stream of ``stripe`` from ``parent`` once it arrives (``trio.TooSlowError``
        after ``timeout``)."""
        slot = self._slot(state.version, stripe, parent)
        with trio.fail_after(timeout):
            await slot.arrived.wait()
        return PushedSource(slot, self.server.transport.io_timeout)


class Pusher:
    """The parent side: push a stripe to a reachable child that cannot dial us."""

    def __init__(self, server: ChunkServer, direct: bool = True) -> None:
        self.server = server
        self.direct = direct
        self.transport = Libp2pTransport(server.host, PUSH_STREAM, server.limiter,
                                         io_timeout=server.transport.io_timeout)
        self.pushed_streams = 0

    async def _open(self, state: VersionState, stripe: int, child: str) -> Any:
        sub = Subscribe(run_id=self.server.run_id, version=state.version, stripe=stripe)
        ip = ip_of(next((m.addrs for m in state.announce.members if m.peer_id == child), []))
        if self.direct and ip is not None:
            try:
                ticket = await self.server.host.request(child, PUSH, sub, expect=StreamTicket,
                                                        timeout=self.server.announce_wait_s + 10.0)
                assert isinstance(ticket, StreamTicket)
                source = await open_direct(ip, ticket.port, ticket.ticket, self.server.transport.io_timeout)
                return source.stream
            except (PeerUnavailable, RemoteError) as exc:
                log.info("direct push to %s unavailable (%s): libp2p stream", short_id(child), exc)
        return (await self.transport.subscribe(child, sub)).stream

    async def push(self, state: VersionState, stripe: int, child: str) -> None:
        """Dial ``child`` and stream it ``stripe`` of ``state``'s version as the chunks arrive
        here; failures are logged (the child recovers the stripe from other holders)."""
        stream = None
        try:
            stream = await self._open(state, stripe, child)
            self.pushed_streams += 1
            await self.server.serve_stripe(stream, state, stripe)  # closes the stream when done
        except Exception as exc:  # noqa: BLE001 - one child's push must not end the relay
            log.info("v%d stripe %d: push to %s failed: %s: %s", state.version, stripe, short_id(child),
                     type(exc).__name__, exc)
            if stream is not None:
                await reset_quietly(stream)
