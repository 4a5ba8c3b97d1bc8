"""The chunk-transport interface: what the broadcast sees of any path that carries a stripe's
``Chunk`` frames between two peers. One file per implementation sits beside it
(``libp2p_streams.py``, ``direct_tcp.py``); ``paths.py`` picks one for a peer.

A ``ChunkTransport`` dials a peer and asks for one stripe (``Subscribe``): the child pulling
from its parent, or a parent pushing to a child that cannot dial it. Either way the result is a
``ChunkStream``: the receiving end reads ``frames()``, the sending end ``send``s frame bodies,
paced by the process's ``UploadLimiter``. Every read and write has a deadline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import trio

from echorl.net.framing import CleanEnd, read_frame, reset_quietly
from echorl.net.transport.pacing import UploadLimiter, write_paced
from echorl.protocol import limits
from echorl.protocol.messages import Subscribe

#: largest frame of a chunk stream: a Chunk message of MAX_CHUNK_BYTES plus msgpack overhead
MAX_CHUNK_FRAME = limits.MAX_CHUNK_BYTES + 1024
CLOSE_WAIT_S = 5.0  # a sender's clean close (the muxer's FIN) waits at most this long


class ChunkStream(ABC):
    """One open chunk stream, at either end."""

    io_timeout: float  # one frame once its first byte arrived / one paced slice written
    transit_s: float = 0.0  # read so far: seconds from each frame's first byte to its last

    @abstractmethod
    def frames(self, first_byte_timeout: float, frame_timeout: float | None = None) -> AsyncIterator[bytes]:
        """Frame bodies (encoded ``Chunk`` messages) until the sender closes: each one's first
        byte within ``first_byte_timeout``, the rest within ``frame_timeout`` (at most
        ``io_timeout``)."""

    @abstractmethod
    async def send(self, frame_body: bytes) -> None:
        """Write one frame, paced."""

    @abstractmethod
    async def close(self) -> None:
        """The sender is done: end the stream cleanly (the reader sees the end)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Abandon the stream (reset it)."""


class ChunkTransport(ABC):
    """One path to a peer. ``open`` raises ``PeerUnavailable`` or ``RemoteError``."""

    name: ClassVar[str]

    @abstractmethod
    async def open(self, peer: str, request: Subscribe) -> ChunkStream:
        """Dial ``peer`` and ask for ``request``'s stripe."""


class FramedStream(ChunkStream):
    """A ``ChunkStream`` over any byte stream with ``read``/``write``/``close``/``reset`` (a
    libp2p stream, or ``TcpStreamAdapter`` on the direct path): both transports' frames."""

    def __init__(self, stream: Any, io_timeout: float, limiter: UploadLimiter | None = None) -> None:
        self.stream = stream
        self.io_timeout = io_timeout
        self.limiter = limiter or UploadLimiter(None)

    async def frames(self, first_byte_timeout: float, frame_timeout: float | None = None) -> AsyncIterator[bytes]:
        io_timeout = min(self.io_timeout, frame_timeout or self.io_timeout)
        while True:
            began: list[float] = []
            try:
                body = await read_frame(
                    self.stream,
                    max_bytes=MAX_CHUNK_FRAME,
                    first_byte_timeout=first_byte_timeout,
                    io_timeout=io_timeout,
                    began=began,
                )
            except CleanEnd:
                return
            self.transit_s += trio.current_time() - began[0]
            yield body

    async def send(self, frame_body: bytes) -> None:
        await write_paced(self.stream, frame_body, self.limiter, self.io_timeout)

    async def close(self) -> None:
        with trio.move_on_after(CLOSE_WAIT_S):
            await self.stream.close()

    async def aclose(self) -> None:
        await reset_quietly(self.stream)
