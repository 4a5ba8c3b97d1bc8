"""The one place the chunk path to a peer is picked.

An edge of the broadcast plan is dialed one way: the child pulls from its parent (``PULL``:
ticket route ``TICKET``, stream route ``STREAM``), or a parent that cannot be dialled pushes to
its child (``PUSHED``: ``PUSH``, ``PUSH_STREAM``). ``ChunkDialer.paths`` lists the transports to
try for a peer, best first, from what is known about it: the ticketed direct TCP path when this
peer runs one and the other end has not said it has none, then libp2p streams, which always
work. ``open`` tries them in turn; a failed direct path falls back to libp2p within the same call.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from echorl.net.host import Host, PeerUnavailable, RemoteError
from echorl.net.transport.base import ChunkStream, ChunkTransport
from echorl.net.transport.direct_tcp import DirectTransport
from echorl.net.transport.libp2p_streams import Libp2pTransport
from echorl.net.transport.pacing import UploadLimiter
from echorl.protocol import routes
from echorl.protocol.errors import ErrorCode
from echorl.protocol.identity import short_id
from echorl.protocol.messages import Subscribe

log = logging.getLogger(__name__)

#: a peer that answered "no direct path here" is dialed over libp2p only, for this long (its
#: direct port may come up later: a relay starts it when its run task starts)
NO_DIRECT_S = 60.0
MAX_REMEMBERED = 4096


@dataclass(frozen=True)
class Edge:
    """The two stream ids of one dialing direction: the direct path's ticket route and the
    libp2p chunk-stream route."""

    ticket_route: str
    stream_route: str


PULL = Edge(routes.TICKET, routes.STREAM)  # the child dials its parent
PUSHED = Edge(routes.PUSH, routes.PUSH_STREAM)  # a parent behind NAT dials its child


class ChunkDialer:
    """Opens chunk streams of one ``edge`` direction to peers, by the best path known."""

    def __init__(
        self,
        host: Host,
        edge: Edge,
        limiter: UploadLimiter,
        *,
        direct: bool,
        io_timeout: float,
        ticket_timeout_s: float,
    ) -> None:
        self.direct = direct
        self._direct = DirectTransport(host, edge.ticket_route, limiter, io_timeout, ticket_timeout_s)
        self._libp2p = Libp2pTransport(host, edge.stream_route, limiter, io_timeout)
        self._no_direct: dict[str, float] = {}  # peer -> when it said it has no direct port
        self.opened: Counter[str] = Counter()  # streams opened, by transport name

    def paths(self, peer: str) -> list[ChunkTransport]:
        """The transports to try for ``peer``, best first."""
        said_none = self._no_direct.get(peer)
        if said_none is not None and time.monotonic() - said_none > NO_DIRECT_S:
            del self._no_direct[peer]
            said_none = None
        if self.direct and said_none is None:
            return [self._direct, self._libp2p]
        return [self._libp2p]

    async def open(self, peer: str, request: Subscribe) -> ChunkStream:
        """A chunk stream to ``peer`` for ``request``'s stripe; raises ``PeerUnavailable`` or
        ``RemoteError`` from the last path tried."""
        paths = self.paths(peer)
        for i, transport in enumerate(paths):
            try:
                stream = await transport.open(peer, request)
            except (PeerUnavailable, RemoteError) as exc:
                if i == len(paths) - 1:
                    raise
                self._note_failure(peer, exc)
                log.info("%s path to %s unavailable (%s): %s", transport.name, short_id(peer), exc, paths[i + 1].name)
                continue
            self.opened[transport.name] += 1
            return stream
        raise AssertionError("paths() is never empty")

    def _note_failure(self, peer: str, exc: Exception) -> None:
        if isinstance(exc, RemoteError) and exc.code == ErrorCode.UNAVAILABLE:
            if len(self._no_direct) >= MAX_REMEMBERED:
                self._no_direct.pop(next(iter(self._no_direct)))
            self._no_direct[peer] = time.monotonic()
