"""Length-prefixed frames on a libp2p stream, each read and write under a deadline.

A frame is ``wire.frame``: 4-byte big-endian length, then the body. Reading tells a clean end
(the peer closed between frames) apart from a truncated frame (the peer died mid-message), which
py-libp2p alone cannot: a killed peer and a closed stream both surface as ``StreamEOF``.
"""

from __future__ import annotations

from typing import Any

import trio
from libp2p.io.exceptions import IOException

from echorl.protocol import wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import Message

#: Errors of the stream itself (reset, EOF, closed connection, muxer failures).
STREAM_ERRORS: tuple[type[BaseException], ...] = (IOException, EOFError, ConnectionError, OSError)


class CleanEnd(Exception):
    """The peer closed the stream at a frame boundary."""


class IdleTimeout(trio.TooSlowError):
    """No frame began within the idle time: a quiet stream, not a broken one."""


class Truncated(Exception):
    """The stream ended inside a frame: the peer died or reset the stream mid-message."""


async def read_exact(stream: Any, n: int, *, at_boundary: bool = False) -> bytes:
    """Read exactly ``n`` bytes. End of stream before the first byte with ``at_boundary`` raises
    ``CleanEnd``; any other early end raises ``Truncated``."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        try:
            data = await stream.read(n - got)
        except EOFError:  # StreamEOF subclasses EOFError
            data = b""
        except IOException as exc:
            raise Truncated(f"{type(exc).__name__} after {got}/{n} bytes") from None
        if not data:
            if got == 0 and at_boundary:
                raise CleanEnd()
            raise Truncated(f"end of stream after {got}/{n} bytes")
        parts.append(data)
        got += len(data)
    return b"".join(parts)


async def read_frame(
    stream: Any, *, max_bytes: int, first_byte_timeout: float, io_timeout: float, began: list[float] | None = None
) -> bytes:
    """One frame's body. Waits up to ``first_byte_timeout`` for the header (idle time), then
    ``io_timeout`` for the rest; ``began`` gets the time (``trio.current_time``) its first byte
    came. Raises ``CleanEnd``, ``IdleTimeout`` (a ``trio.TooSlowError``: no header in time),
    ``Truncated``, ``trio.TooSlowError`` (a frame begun but not finished) or
    ``ProtocolError(OVERSIZED)`` (announced length above ``max_bytes``, nothing read for it)."""
    try:
        with trio.fail_after(first_byte_timeout):
            first = await read_exact(stream, 1, at_boundary=True)
    except trio.TooSlowError:
        raise IdleTimeout(f"no frame within {first_byte_timeout:.1f} s") from None
    if began is not None:
        began.append(trio.current_time())
    with trio.fail_after(io_timeout):
        header = first + await read_exact(stream, wire.FRAME_HEADER.size - 1)
        length = wire.frame_length(header, max_bytes)
        return await read_exact(stream, length) if length else b""


async def write_frame(stream: Any, payload: bytes, *, timeout: float) -> None:
    with trio.fail_after(timeout):
        await stream.write(wire.frame(payload))


async def write_message(stream: Any, msg: Message, *, timeout: float) -> None:
    await write_frame(stream, wire.encode(msg), timeout=timeout)


def error_message(exc: ProtocolError) -> Message:
    from echorl.protocol.messages import Error

    return Error(code=exc.code.value, detail=exc.detail[:1024])


def protocol_error_from(msg: Message) -> ProtocolError:
    """The ``ProtocolError`` an ``Error`` reply stands for (unknown codes map to INTERNAL)."""
    code = getattr(msg, "code", ErrorCode.INTERNAL.value)
    try:
        err_code = ErrorCode(code)
    except ValueError:
        err_code = ErrorCode.INTERNAL
    return ProtocolError(err_code, getattr(msg, "detail", ""))


async def reset_quietly(stream: Any) -> None:
    """Reset a stream, ignoring every failure (it may already be dead)."""
    with trio.move_on_after(2.0):
        try:
            await stream.reset()
        except Exception:
            pass


async def close_quietly(stream: Any) -> None:
    with trio.move_on_after(2.0):
        try:
            await stream.close()
        except Exception:
            pass
