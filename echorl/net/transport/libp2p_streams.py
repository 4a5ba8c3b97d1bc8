"""Chunk streams over the host's libp2p connections (Noise + yamux): the path that always works.

The dialing end opens one stream per (version, stripe) on a raw stream route (``STREAM`` when a
child pulls, ``PUSH_STREAM`` when a parent pushes) and writes the ``Subscribe`` as its first
frame; then ``Chunk`` frames flow. It works through NAT (whoever can dial, dials) and costs ~16
CPU-s per GB on both ends together (architecture §9). ``serve_raw`` installs the serving end: a
raw libp2p stream handler that nothing can escape (an exception in a py-libp2p stream handler
takes the whole host down, architecture §9).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from echorl.net.framing import STREAM_ERRORS, read_frame, reset_quietly
from echorl.net.host import Host, PeerUnavailable
from echorl.net.serving import Admit
from echorl.net.transport.base import ChunkStream, ChunkTransport, FramedStream
from echorl.net.transport.pacing import UploadLimiter
from echorl.protocol import wire
from echorl.protocol.identity import short_id
from echorl.protocol.messages import Subscribe
from echorl.protocol.routes import ROUTES

log = logging.getLogger(__name__)

#: a served chunk stream's first frame (its ``Subscribe``) must arrive within this long
SUBSCRIBE_WAIT_S = 10.0
#: (the stream's ``Subscribe``, the stream, the authenticated remote peer id)
RawHandler = Callable[[Subscribe, ChunkStream, str], Awaitable[None]]


class Libp2pTransport(ChunkTransport):
    """Open a chunk stream on ``route`` over libp2p (a connection the swarm reuses)."""

    name = "libp2p"

    def __init__(self, host: Host, route: str, limiter: UploadLimiter, io_timeout: float = 15.0) -> None:
        self.host = host
        self.route = route
        self.limiter = limiter
        self.io_timeout = io_timeout

    async def open(self, peer: str, request: Subscribe) -> ChunkStream:
        self.host.prepare_dial(peer)
        try:
            with trio.fail_after(self.host.config.connect_timeout_s + 5.0):
                stream = await self.host.libp2p.new_stream(ID.from_base58(peer), [TProtocol(self.route)])
        except trio.TooSlowError:
            raise PeerUnavailable(f"open chunk stream to {short_id(peer)}: timed out") from None
        except Exception as exc:
            raise PeerUnavailable(f"open chunk stream to {short_id(peer)}: {type(exc).__name__}: {exc}") from None
        try:
            with trio.fail_after(self.io_timeout):
                await stream.write(wire.frame(wire.encode(request)))
        except (trio.TooSlowError, *STREAM_ERRORS) as exc:
            await reset_quietly(stream)
            raise PeerUnavailable(f"subscribe to {short_id(peer)}: {type(exc).__name__}") from None
        return FramedStream(stream, self.io_timeout, self.limiter)


def serve_raw(
    host: Host,
    route: str,
    handler: RawHandler,
    limiter: UploadLimiter,
    io_timeout: float,
    admit: Admit | None = None,
) -> None:
    """Serve the raw chunk-stream ``route``: the sender check ``admit`` first (as on every
    route: ``RouteServer.admitted``, nothing read from a refused peer), then its first frame, a
    ``Subscribe`` (at most the route's request cap, within ``SUBSCRIBE_WAIT_S``), then
    ``handler(subscribe, stream, remote_peer_id)`` with the stream a ``FramedStream`` paced by
    ``limiter``. Nothing the handler raises can crash the host: the stream is reset and the
    failure logged."""
    cap = ROUTES[route].max_request_bytes

    async def _entry(raw: Any) -> None:
        peer = "?"
        try:
            peer = str(raw.muxed_conn.peer_id)
            if not await host.serving.admitted(raw, peer, admit):
                return
            body = await read_frame(
                raw, max_bytes=cap, first_byte_timeout=SUBSCRIBE_WAIT_S, io_timeout=SUBSCRIBE_WAIT_S
            )
            sub = wire.decode(body, expect=Subscribe)
            assert isinstance(sub, Subscribe)
            await handler(sub, FramedStream(raw, io_timeout, limiter), peer)
        except Exception as exc:
            log.info("%s stream from %s ended: %s: %s", route, short_id(peer), type(exc).__name__, exc)
            await reset_quietly(raw)

    host.libp2p.set_stream_handler(TProtocol(route), _entry)
