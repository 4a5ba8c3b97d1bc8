"""Pushed edges of the broadcast plan: a parent behind NAT cannot be dialled, so it dials its
(reachable) plan child and pushes its stripe to it (``BroadcastPlan.pushed``). This is what
lets a NAT'd node's uplink carry the broadcast instead of idling as a leaf.

Parent side, ``Pusher.push``: open a chunk stream to the child by the ``PUSHED`` edge's paths
(``net/transport/paths.py``: a push ticket over ``PUSH``, then the child's direct chunk port on
the IP of the authenticated connection to it; else a libp2p stream on ``PUSH_STREAM``, first
frame the ``Subscribe``), then write the stripe's ``Chunk`` frames exactly as for a pulled edge
(``ChunkServer.serve_stripe``).

Child side, ``PushInbox``: issues tickets (from the server's ``TicketBook``) only to the peer its
plan names as the pushing parent of that stripe (the caller is authenticated by libp2p; the
ticket binds the TCP connection to it, and every chunk is verified against the signed manifest
anyway), and hands the accepted connection to the receiving task, which reads it like a pulled
stream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import trio

from echorl.broadcast.chunk_server import ChunkServer
from echorl.broadcast.store import VersionState
from echorl.net.host import RequestContext
from echorl.net.transport import PUSHED, ChunkStream, serve_raw
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import Message, StreamTicket, Subscribe
from echorl.protocol.routes import PUSH, PUSH_STREAM

log = logging.getLogger("echorl.broadcast.push")

MAX_SLOTS = 256  # (version, stripe) hand-overs waiting at once
HAND_OVER_S = 30.0  # a hand-over of a version no longer in flight waits at most this long


@dataclass
class _Slot:
    """One (version, stripe) hand-over: the pushing parent's stream, once it arrives."""

    parent: str
    arrived: trio.Event = field(default_factory=trio.Event)
    finished: trio.Event = field(default_factory=trio.Event)
    stream: ChunkStream | None = None


class PushedSource(ChunkStream):
    """The child's end of a pushed stripe: the frames of the parent's stream (libp2p or direct
    TCP); ``aclose`` lets the connection go (its acceptor closes it)."""

    def __init__(self, slot: _Slot) -> None:
        assert slot.stream is not None
        self._slot = slot
        self._stream = slot.stream
        self.io_timeout = slot.stream.io_timeout

    @property
    def transit_s(self) -> float:  # type: ignore[override]
        return self._stream.transit_s

    def frames(self, first_byte_timeout: float, frame_timeout: float | None = None) -> AsyncIterator[bytes]:
        return self._stream.frames(first_byte_timeout, min(self.io_timeout, frame_timeout or self.io_timeout))

    async def send(self, frame_body: bytes) -> None:
        raise ProtocolError(ErrorCode.INTERNAL, "a pushed stripe is read, not written")

    async def close(self) -> None:
        self._slot.finished.set()

    async def aclose(self) -> None:
        self._slot.finished.set()


class PushInbox:
    """The child side: push tickets for its plan parents on pushed edges, and the hand-over of
    their connections to ``wait``."""

    def __init__(self, server: ChunkServer) -> None:
        self.server = server
        self._slots: dict[tuple[int, int], _Slot] = {}

    def install(self) -> None:
        server = self.server
        admit = server.admits_soon if server.admit is not None else None  # the weight routes' sender check
        server.host.serve({PUSH: self._on_ticket}, admit={PUSH: admit} if admit else None)
        serve_raw(server.host, PUSH_STREAM, self._on_stream, server.limiter, server.io_timeout, admit=admit)

    async def _check(self, sub: Subscribe, peer: str) -> VersionState:
        if sub.run_id != self.server.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "other run")
        state = await self.server.state_for(sub.version)
        if state is None or sub.stripe >= state.n_stripes:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no stripe {sub.stripe} of v{sub.version} here")
        if state.parents.get(sub.stripe) != peer or not state.plan.pushed(peer, state.me):
            raise ProtocolError(
                ErrorCode.NOT_FOUND, f"{short_id(peer)} is not my pushing parent in stripe {sub.stripe}"
            )
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
        parent, version, stripe = ctx.peer_id, msg.version, msg.stripe

        async def on_connect(stream: ChunkStream) -> None:  # the direct connection: hand it over
            await self._hand_over(self._slot(version, stripe, parent), stream, version, stripe)

        return StreamTicket(ticket=self.server.tickets.issue(parent, on_connect), port=self.server.direct_port)

    async def _on_stream(self, sub: Subscribe, stream: ChunkStream, peer: str) -> None:
        await self._check(sub, peer)
        try:
            await self._hand_over(self._slot(sub.version, sub.stripe, peer), stream, sub.version, sub.stripe)
        finally:
            await stream.aclose()

    async def _hand_over(self, slot: _Slot, stream: ChunkStream, version: int, stripe: int) -> None:
        """Give ``stream`` to the waiting receiver; return when it is done with it."""
        if slot.arrived.is_set():
            raise ProtocolError(ErrorCode.NOT_FOUND, "this stripe was pushed already")
        slot.stream = stream
        slot.arrived.set()
        state = self.server.states.get(version)
        with trio.move_on_after(self.server.stripe_deadline(state, stripe) if state else HAND_OVER_S):
            await slot.finished.wait()
        self._slots.pop((version, stripe), None)

    async def wait(self, state: VersionState, stripe: int, parent: str, timeout: float) -> PushedSource:
        """The pushed stream of ``stripe`` from ``parent`` once it arrives (``trio.TooSlowError``
        after ``timeout``)."""
        slot = self._slot(state.version, stripe, parent)
        with trio.fail_after(timeout):
            await slot.arrived.wait()
        return PushedSource(slot)


class Pusher:
    """The parent side: push a stripe to a reachable child that cannot dial us."""

    def __init__(self, server: ChunkServer) -> None:
        self.server = server
        self.dialer = server.dialer(PUSHED, ticket_timeout_s=server.announce_wait_s + 10.0)

    @property
    def pushed_streams(self) -> int:
        return sum(self.dialer.opened.values())

    async def push(self, state: VersionState, stripe: int, child: str) -> None:
        """Dial ``child`` and stream it ``stripe`` of ``state``'s version as the chunks arrive
        here; failures are logged (the child recovers the stripe from other holders)."""
        stream = None
        try:
            sub = Subscribe(run_id=self.server.run_id, version=state.version, stripe=stripe)
            stream = await self.dialer.open(child, sub)
            await self.server.serve_stripe(stream, state, stripe)  # closes the stream when done
        except Exception as exc:
            log.info(
                "v%d stripe %d: push to %s failed: %s: %s",
                state.version,
                stripe,
                short_id(child),
                type(exc).__name__,
                exc,
            )
            if stream is not None:
                await stream.aclose()
