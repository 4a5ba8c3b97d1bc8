"""Chunk transport for the broadcast: long-lived framed chunk streams, paced by an upload limit.

* ``UploadLimiter``: one token bucket per process (bytes/s), FIFO-fair between the streams that
  share it, so a peer's children and recovery requests together never exceed its upload cap
  (WAN emulation in benchmarks; a volunteer's cap in production). ``None`` rate = unlimited.
* ``ChunkTransport`` (interface) / ``Libp2pTransport`` (default): a child opens one stream to
  its parent per (version, stripe) and the parent writes ``Chunk`` frames on it as the chunks
  become available. The child always dials, so peers behind NAT work as leaves. Each frame is
  written in slices of ``UploadLimiter.slice_bytes`` (about 5 ms of the capped rate), each slice
  paid for in the limiter, so concurrent children of one parent interleave fairly instead of one
  child getting a whole chunk first.
* ``serve_raw``: installs a raw libp2p stream handler that nothing can escape (an exception in
  a py-libp2p stream handler takes the whole host down, architecture §9).

Every read and write has a deadline.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from echorl.protocol import limits, wire
from echorl.protocol.messages import Message

from echorl.net.framing import STREAM_ERRORS, CleanEnd, Truncated, read_frame, reset_quietly
from echorl.net.host import Host, PeerUnavailable
from echorl.protocol.identity import short_id

log = logging.getLogger("echorl.net.transport")

#: a slice of a paced write lasts about this long at the capped rate: short enough that children
#: sharing an uplink interleave finely, long enough that the per-slice cost (a limiter turn, a
#: send, a trio checkpoint: tens of µs of Python) stays small. At 400 Mbit/s a fixed 64 KiB slice
#: (1.3 ms) cost a quarter of a 1 GB broadcast's CPU (docs/broadcast-notes.md, wave 5).
SLICE_SECONDS = 0.005
MIN_SLICE_BYTES, MAX_SLICE_BYTES = 64 * 1024, 1024 * 1024
UNPACED_SLICE_BYTES = 256 * 1024  # no cap: the kernel paces; slices only bound one write
_SLICE_OVERRIDE = int(os.environ.get("ECHORL_SLICE_BYTES", 0))  # benchmarks: a fixed slice
#: largest frame of a chunk stream: a Chunk message of MAX_CHUNK_BYTES plus msgpack overhead
MAX_CHUNK_FRAME = limits.MAX_CHUNK_BYTES + 1024


class UploadLimiter:
    """Async token bucket in bytes per second; ``acquire`` waits FIFO (trio.Lock is fair)."""

    def __init__(self, bytes_per_s: float | None, burst_bytes: int | None = None) -> None:
        self.rate = bytes_per_s if bytes_per_s and bytes_per_s > 0 else None
        self.slice_bytes = _SLICE_OVERRIDE or slice_bytes_for(self.rate)
        self.burst = max(burst_bytes or self.slice_bytes, 1)
        self._tokens = float(self.burst)
        self._last = time.monotonic()
        self._lock = trio.Lock()
        self.sent_bytes = 0

    @classmethod
    def from_mbps(cls, mbps: float | None) -> "UploadLimiter":
        """Megabits per second (20 Mbps = 2.5 MB/s); None or 0 = unlimited."""
        return cls(mbps * 1e6 / 8 if mbps else None)

    async def acquire(self, n: int) -> None:
        self.sent_bytes += n
        if self.rate is None:
            return
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens < n:
                await trio.sleep((n - self._tokens) / self.rate)
                now = time.monotonic()
                self._tokens += (now - self._last) * self.rate
                self._last = now
            self._tokens -= n


def slice_bytes_for(rate: float | None) -> int:
    """Bytes per paced write at ``rate`` bytes/s: ``SLICE_SECONDS`` of it, a multiple of 4 KiB
    within [``MIN_SLICE_BYTES``, ``MAX_SLICE_BYTES``]; ``UNPACED_SLICE_BYTES`` without a cap."""
    if rate is None:
        return UNPACED_SLICE_BYTES
    return max(MIN_SLICE_BYTES, min(MAX_SLICE_BYTES, int(rate * SLICE_SECONDS) // 4096 * 4096))


async def write_paced(stream: Any, body: bytes, limiter: UploadLimiter, timeout: float) -> None:
    """Write ``body`` as one frame (its length prefix, then the bytes) in slices of
    ``limiter.slice_bytes``, each paid for in ``limiter`` and written within ``timeout``. A
    stream with ``accepts_views`` is handed slices of ``body`` itself; others get copies."""
    view, step = memoryview(body), limiter.slice_bytes
    first = max(step - wire.FRAME_HEADER.size, 0)
    pieces = [wire.frame_header(len(body)) + view[:first]]
    pieces += (view[i : i + step] for i in range(first, len(view), step))
    copy = not getattr(stream, "accepts_views", False)
    for piece in pieces:
        await limiter.acquire(len(piece))
        with trio.fail_after(timeout):
            await stream.write(bytes(piece) if copy and isinstance(piece, memoryview) else piece)


def serve_raw(host: Host, protocol: str, handler: Callable[[Any, str], Awaitable[None]]) -> None:
    """Install ``handler(stream, remote_peer_id)`` for ``protocol``; it can never crash the host."""

    async def _entry(stream: Any) -> None:
        peer = "?"
        try:
            peer = str(stream.muxed_conn.peer_id)
            await handler(stream, peer)
        except Exception as exc:  # noqa: BLE001 - an escaping error would kill the host
            log.info("%s stream from %s ended: %s: %s", protocol, short_id(peer), type(exc).__name__, exc)
            await reset_quietly(stream)

    host.libp2p.set_stream_handler(TProtocol(protocol), _entry)


class ChunkSource(Protocol):
    """A subscription as the child sees it: ``frames()`` yields raw frame bodies (encoded
    ``Chunk`` messages); ``aclose()`` ends it."""

    def frames(self, first_byte_timeout: float) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class ChunkTransport(Protocol):
    """How chunk streams are opened (child side) and written (parent side)."""

    async def subscribe(self, parent: str, request: Message) -> ChunkSource: ...

    async def send(self, sink: Any, frame_body: bytes) -> None: ...


class _Libp2pSource:
    def __init__(self, stream: Any, io_timeout: float) -> None:
        self.stream = stream
        self.io_timeout = io_timeout

    async def frames(self, first_byte_timeout: float) -> AsyncIterator[bytes]:
        while True:
            try:
                body = await read_frame(self.stream, max_bytes=MAX_CHUNK_FRAME,
                                        first_byte_timeout=first_byte_timeout, io_timeout=self.io_timeout)
            except CleanEnd:
                return
            yield body

    async def aclose(self) -> None:
        await reset_quietly(self.stream)


class Libp2pTransport:
    """Chunk streams over the host's libp2p connections (Noise + yamux): works through NAT
    (children dial parents), costs ~16 CPU-s per GB on both ends together (architecture §9)."""

    def __init__(self, host: Host, protocol: str, limiter: UploadLimiter, io_timeout: float = 15.0) -> None:
        self.host = host
        self.protocol = protocol
        self.limiter = limiter
        self.io_timeout = io_timeout

    async def subscribe(self, parent: str, request: Message) -> ChunkSource:
        try:
            with trio.fail_after(self.host.config.connect_timeout_s + 5.0):
                stream = await self.host.libp2p.new_stream(ID.from_base58(parent), [TProtocol(self.protocol)])
        except trio.TooSlowError:
            raise PeerUnavailable(f"open chunk stream to {short_id(parent)}: timed out") from None
        except Exception as exc:  # noqa: BLE001
            raise PeerUnavailable(f"open chunk stream to {short_id(parent)}: {type(exc).__name__}: {exc}") from None
        try:
            with trio.fail_after(self.io_timeout):
                await stream.write(wire.frame(wire.encode(request)))
        except (trio.TooSlowError, *STREAM_ERRORS) as exc:
            await reset_quietly(stream)
            raise PeerUnavailable(f"subscribe to {short_id(parent)}: {type(exc).__name__}") from None
        return _Libp2pSource(stream, self.io_timeout)

    async def send(self, sink: Any, frame_body: bytes) -> None:
        await write_paced(sink, frame_body, self.limiter, self.io_timeout)


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


def ip_of(addrs: list[str] | tuple[str, ...]) -> str | None:
    """The first IPv4 address of a list of multiaddrs (``/ip4/1.2.3.4/tcp/…``)."""
    for a in addrs:
        parts = a.split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
    return None


class DirectSource(_Libp2pSource):
    """The child's end of a direct TCP chunk stream (ticket already sent): the same frames,
    read through a ``TcpStreamAdapter``."""

    def __init__(self, stream: trio.abc.Stream, io_timeout: float) -> None:
        super().__init__(TcpStreamAdapter(stream), io_timeout)

    async def aclose(self) -> None:
        await self.stream.reset()


async def open_direct(ip: str, port: int, ticket: bytes, io_timeout: float) -> DirectSource:
    """Dial a parent's direct chunk port and present the ticket. Raises PeerUnavailable."""
    try:
        with trio.fail_after(io_timeout):
            stream = await trio.open_tcp_stream(ip, port)
            await stream.send_all(ticket)
    except (trio.TooSlowError, OSError) as exc:
        raise PeerUnavailable(f"direct {ip}:{port}: {type(exc).__name__}: {exc}") from None
    return DirectSource(stream, io_timeout)


__all__ = [
    "TcpStreamAdapter", "DirectSource", "open_direct", "ip_of",
    "UploadLimiter", "write_paced", "serve_raw", "ChunkSource", "ChunkTransport", "Libp2pTransport",
    "Truncated", "CleanEnd", "MAX_CHUNK_FRAME",
]
